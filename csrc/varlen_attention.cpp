// Varlen attention forward for CPU (`packing._varlen_attention`): one kernel for a packed training
// row, a chunk of a prompt and a decode token, with keys read in place from a flat row or from the
// blocks of a paged KV cache, in fp32, bf16 or fp16.
//
// Why one kernel: the generator and the trainer must compute every token's attention the same way
// for their log-probs to be bitwise equal (packing.batch_invariant). Here each query's result
// depends on nothing but its own keys: keys are visited in fixed blocks of BK, aligned to key 0,
// in order; each score is a dot product over the head dimension split into L = 16 lanes (lane l
// sums d = l, l + 16, ... in order by fused multiply-adds, the lanes are then added by a fixed
// halving tree); a block's softmax weights are summed by a fixed halving tree; each value
// accumulation adds p * v key by key in order (fused multiply-add); softmax is online across
// blocks, in fp32. Which other queries, sequences or threads share the call, or how queries are
// tiled, never changes any of these sums. Fused multiply-adds are explicit and the file is built
// with -ffp-contract=off, so the portable path and the AVX-512 path give the same bits.
//
// Speed: decode (few query rows per KV head) reads each key's row of all KV heads in place,
// converting bf16/fp16 in registers, prefetches the next block while computing this one (and the
// first block of the thread's next item during an item's last), and runs each row's softmax 16
// keys per vector. Prefill chunks and training rows (>= 16 query rows per KV
// head) go head by head: the queries are transposed once, each key/value block is converted to
// fp32 once, and scores and the online softmax run 16 query rows per vector (the 16 lanes of a
// score become 16 accumulators, added by the same tree), so no horizontal sums. Both give the
// portable path's bits. It is also the generation kernel of the default mode: no gather copy of
// cached keys for decode or for prefill chunks, and one call per layer.
//
// No torch at build time: the caller passes the data pointers of contiguous CPU tensors.
// Layout: q, out [total_q, H, D]; k, v [rows, Hkv, D] where key p of sequence i is row
// table[i, p / bs] * bs + p % bs (paged) or k_start[i] + p (flat); query head h uses KV head
// h / (H / Hkv). Causal masks align to the end of each sequence's keys (a decode token is the
// last key), sliding window W keeps keys p - W < key <= p.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using i32 = int32_t;
using i64 = int64_t;
using u16 = uint16_t;
using u32 = uint32_t;

namespace {

#define ALWAYS_INLINE inline __attribute__((always_inline))

constexpr int BK = 32;  // keys per block: the fixed unit of every reduction over keys
constexpr int QT = 16;  // query tokens per work item (a scheduling choice; results do not depend on it)
constexpr int MAX_D = 256;  // head dims the kernel takes (kernel_attention.MAX_HEAD_DIM)
constexpr int L = 16;   // lanes of a score's dot product over the head dim (fixed, part of the order)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };

ALWAYS_INLINE float bf16_to_f32(u16 b) {
    u32 u = static_cast<u32>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

ALWAYS_INLINE u16 f32_to_bf16(float f) {  // round to nearest even, as torch does
    u32 u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<u16>(u >> 16);
}

template <int DT>
ALWAYS_INLINE float load(const void* base, i64 i) {
    if constexpr (DT == F32) return static_cast<const float*>(base)[i];
    if constexpr (DT == BF16) return bf16_to_f32(static_cast<const u16*>(base)[i]);
    if constexpr (DT == F16) return static_cast<float>(static_cast<const _Float16*>(base)[i]);
}

template <int DT>
ALWAYS_INLINE void store(void* base, i64 i, float x) {
    if constexpr (DT == F32) static_cast<float*>(base)[i] = x;
    if constexpr (DT == BF16) static_cast<u16*>(base)[i] = f32_to_bf16(x);
    if constexpr (DT == F16) static_cast<_Float16*>(base)[i] = static_cast<_Float16>(x);
}

// exp for x <= 0 (scores minus their running max): 2^n * 2^f, f in [-0.5, 0.5], degree-6
// polynomial. Plain arithmetic so it is the same code for every element of every call.
ALWAYS_INLINE float exp_neg(float x) {
    x = std::max(x, -87.0f);
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f;  // round to nearest
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    const u32 bits = static_cast<u32>(static_cast<i32>(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

ALWAYS_INLINE float tanh_fixed(float x) {  // tanh from exp_neg: 1 - 2 / (e^{2|x|} + 1), odd
    const float a = std::fabs(x);
    const float e = exp_neg(-2.0f * a);  // e^{-2a} in (0, 1]
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}

struct Problem {
    const void* q;
    const void* k;
    const void* v;
    void* out;
    const i32* cu_q;
    const i32* lens_k;
    const i64* k_start;  // flat keys, or nullptr
    const i32* table;    // paged keys, or nullptr
    i64 table_width, block_size;
    i64 H, Hkv, D;
    float scale, softcap;
    i64 window;  // 0: none
    bool causal;
    const float* sinks;  // per query head, or nullptr (gpt-oss's attention sinks)
};

// The softmax's denominator of one query row: its keys' sum l (relative to their max m), plus,
// with attention sinks, the head's sink logit, which takes probability mass but adds no value
// (transformers' eager gpt-oss attention: softmax over [scores, sink], the sink column dropped).
ALWAYS_INLINE float denominator(const Problem& P, i64 head, float m, float l) {
    return P.sinks ? l + std::exp(P.sinks[head] - m) : l;
}

// A work item: up to QT query tokens of one sequence, all heads. Its rows are (token, head),
// r = t * H + head; keys are read once per block for every head (a key's row of Hkv * D values is
// contiguous in the cache).
struct Item {
    i64 seq, t0, nt;
};

struct Scratch {  // one per thread
    std::vector<float> q, acc, m, l, s, kt, lanes, kbuf, vbuf;
    std::vector<i64> lo, hi, rows, vrows;
    std::vector<char> active;
    std::vector<i32> lo32, hi32;
    // R rows per item; the rows path pads each head's rows to a multiple of L and keeps a block of
    // keys and one of values in fp32
    Scratch(i64 R, i64 Dp, i64 H)
        : q((R + L) * Dp), acc((R + L) * Dp), m(R + L), l(R + L), s((R + L) * BK), kt(2 * Dp * BK),
          lanes(std::max<i64>(L * BK, R + L)), kbuf(Dp), vbuf(BK * Dp), lo(R), hi(R), rows(2 * BK), vrows(R + H),
          active(R), lo32(R + L), hi32(R + L) {}
};

// The score of one query row and one key: lane l sums q[d] * k[d] over d = l, l + L, l + 2L, ... in
// order (each step one fused multiply-add, exact in every instruction set), then the L lanes are
// added by a fixed halving tree. dot_key does this for one key read in place (decode);
// dot_block does the same sums for a whole block of transposed keys (many query rows). Both give
// the same bits for the same query and key.
ALWAYS_INLINE float lane_tree(float* p) {
    for (int l = 0; l < 8; ++l) p[l] = p[l] + p[l + 8];
    for (int l = 0; l < 4; ++l) p[l] = p[l] + p[l + 4];
    for (int l = 0; l < 2; ++l) p[l] = p[l] + p[l + 2];
    return p[0] + p[1];
}

ALWAYS_INLINE float dot_key(const float* __restrict q, const float* __restrict k, i64 Dp) {
    float p[L] = {};
    for (i64 c = 0; c < Dp; c += L)
        for (int l = 0; l < L; ++l) p[l] = __builtin_fmaf(q[c + l], k[c + l], p[l]);
    return lane_tree(p);
}

// kt is [Dp][BK] (key j of the block at column j); lanes is [L][BK] scratch; s receives BK scores.
ALWAYS_INLINE void dot_block(const float* __restrict q, const float* __restrict kt, float* __restrict lanes,
                             float* __restrict s, i64 Dp) {
    std::fill(lanes, lanes + L * BK, 0.f);
    for (i64 d = 0; d < Dp; ++d) {
        const float qd = q[d];
        const float* kd = kt + d * BK;
        float* ld = lanes + (d % L) * BK;
        for (int j = 0; j < BK; ++j) ld[j] = __builtin_fmaf(qd, kd[j], ld[j]);
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l)
            for (int j = 0; j < BK; ++j) lanes[l * BK + j] = lanes[l * BK + j] + lanes[(l + w) * BK + j];
    for (int j = 0; j < BK; ++j) s[j] = lanes[j];
}

// Keys converted to fp32 into buf (zero-padded to Dp), or read in place when already fp32 and of a
// whole number of lanes.
template <int DT>
ALWAYS_INLINE const float* as_f32(const void* base, i64 offset, i64 D, i64 Dp, float* __restrict buf) {
    if constexpr (DT == F32)
        if (D == Dp) return static_cast<const float*>(base) + offset;
    for (i64 d = 0; d < D; ++d) buf[d] = load<DT>(base, offset + d);
    for (i64 d = D; d < Dp; ++d) buf[d] = 0.f;
    return buf;
}

// The online softmax of one row over one block (scores sr, raw, in; weights out), updating the
// row's running max m, sum l and accumulator ar; keys lo..hi of the block are visible.
ALWAYS_INLINE void softmax_portable(const Problem& P, float* __restrict sr, i64 lo, i64 hi, i64 nk, float& m,
                                    float& l, float* __restrict ar, i64 Dp) {
    float x[BK];
    const i32 jlo = static_cast<i32>(std::max<i64>(lo, 0));
    const i32 jhi = static_cast<i32>(std::min<i64>(hi, nk - 1));
    if (P.softcap > 0.f) {
        for (int j = 0; j < BK; ++j) x[j] = P.softcap * tanh_fixed(sr[j] * P.scale / P.softcap);
    } else {
        for (int j = 0; j < BK; ++j) x[j] = sr[j] * P.scale;
    }
    for (int j = 0; j < BK; ++j) x[j] = j >= jlo && j <= jhi ? x[j] : NEG_INF;
    float mx[BK / 2];  // max by a halving tree (exact in any order)
    for (int j = 0; j < BK / 2; ++j) mx[j] = std::max(x[j], x[j + BK / 2]);
    for (int w = BK / 4; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) mx[j] = std::max(mx[j], mx[j + w]);
    const float m_new = std::max(m, mx[0]);
    const float alpha = m == NEG_INF ? 0.f : exp_neg(m - m_new);
    for (int j = 0; j < BK; ++j) {
        const float e = exp_neg(x[j] - m_new);
        sr[j] = x[j] == NEG_INF ? 0.f : e;
    }
    float p[BK / 2];  // the block's sum by a fixed halving tree
    for (int j = 0; j < BK / 2; ++j) p[j] = sr[j] + sr[j + BK / 2];
    for (int w = BK / 4; w >= 1; w /= 2)
        for (int j = 0; j < w; ++j) p[j] = p[j] + p[j + w];
    l = l * alpha + p[0];
    m = m_new;
    for (i64 d = 0; d < Dp; ++d) ar[d] = ar[d] * alpha;
}

// The decode path's work on one block for the rows rl[0..nr) of KV head h: the scores of its keys
// (key j of the block at cache row rows[j]), and adding p * v over its keys, in key order, to each
// row's accumulator (one fused multiply-add per element). Two implementations with the same
// arithmetic, so the same bits: portable C++, and AVX-512, which converts bf16/fp16 to fp32 in
// registers and keeps a row's accumulator in registers across the block's keys.
template <int DT>
struct PortableOps {
    static void softmax(const Problem& P, float* sr, i64 lo, i64 hi, i64 nk, float& m, float& l, float* ar, i64 Dp) {
        softmax_portable(P, sr, lo, hi, nk, m, l, ar, Dp);
    }
    static void scores(const Problem& P, const i64* rows, i64 nk, i64 h, const float* qb, const i64* rl, i64 nr,
                       float* sc, float* buf, const i64*, i64) {
        const i64 D = P.D, Dp = (D + L - 1) / L * L;
        for (i64 j = 0; j < nk; ++j) {
            const float* kf = as_f32<DT>(P.k, (rows[j] * P.Hkv + h) * D, D, Dp, buf);
            for (i64 i = 0; i < nr; ++i) sc[rl[i] * BK + j] = dot_key(qb + rl[i] * Dp, kf, Dp);
        }
    }
    static void values(const Problem& P, const i64* rows, i64 nk, i64 h, const float* sc, const i64* rl, i64 nr,
                       float* acc, float* buf, const i64*, i64) {
        const i64 D = P.D, Dp = (D + L - 1) / L * L;
        for (i64 j = 0; j < nk; ++j) {
            const float* vf = nullptr;
            for (i64 i = 0; i < nr; ++i) {
                const float pj = sc[rl[i] * BK + j];
                if (pj == 0.f) continue;
                if (!vf) vf = as_f32<DT>(P.v, (rows[j] * P.Hkv + h) * D, D, Dp, buf);
                float* __restrict ar = acc + rl[i] * Dp;
                for (i64 d = 0; d < Dp; ++d) ar[d] = __builtin_fmaf(pj, vf[d], ar[d]);
            }
        }
    }
};

#if defined(__x86_64__)
#define X512 __attribute__((target("arch=x86-64-v4")))

template <int DT>
X512 ALWAYS_INLINE __m512 load16(const void* base, i64 off) {
    if constexpr (DT == F32) {
        return _mm512_loadu_ps(static_cast<const float*>(base) + off);
    } else {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const u16*>(base) + off));
        if constexpr (DT == BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        else return _mm512_cvtph_ps(h);
    }
}

template <int DT, int NC>  // NC chunks of L lanes; the last one zero-padded past D
X512 ALWAYS_INLINE void load_row(const void* base, i64 off, i64 D, __m512* out) {
    if (D == NC * L) {  // the usual head dims (64, 128): no tail
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) out[c] = load16<DT>(base, off + c * L);
        return;
    }
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
        if ((c + 1) * L <= D) {
            out[c] = load16<DT>(base, off + c * L);
        } else {
            alignas(64) float tail[L] = {};
            for (i64 d = c * L; d < D; ++d) tail[d - c * L] = load<DT>(base, off + d);
            out[c] = _mm512_load_ps(tail);
        }
    }
}

inline i64 D_of(const Problem& P) { return P.D; }

template <int DT>  // the next block's row of one head, on its way to L2 while this block computes
ALWAYS_INLINE void prefetch_row(const void* base, i64 off, i64 D) {
    const char* p = static_cast<const char*>(base) + off * (DT == F32 ? 4 : 2);
    for (i64 c = 0; c < D * (DT == F32 ? 4 : 2); c += 64) __builtin_prefetch(p + c, 0, 2);
}

// lane_tree of four rows' lane vectors at once: halves, quarters, pairs, then lane 0 + lane 1, the
// same additions as lane_tree; row i's score ends in lane 4 * i.
X512 ALWAYS_INLINE __m512 lane_tree4(__m512 p0, __m512 p1, __m512 p2, __m512 p3) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(p0, p1, 0x44), _mm512_shuffle_f32x4(p0, p1, 0xEE));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(p2, p3, 0x44), _mm512_shuffle_f32x4(p2, p3, 0xEE));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
    const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
    return _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
}

// exp_neg on 16 lanes: the same operations in the same order as the scalar exp_neg (a separate
// multiply and add per polynomial step, no fused multiply-add), so the same bits.
X512 ALWAYS_INLINE __m512 exp_neg16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);  // (-87 > x) ? -87 : x, as std::max(x, -87)
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(t, _mm512_set1_ps(12582912.0f)), _mm512_set1_ps(12582912.0f));
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Scores of KB keys (fp32 rows kf, Dp apart) for 16 query rows at once (qt: the head's queries
// transposed, [Dp][Rh], this vector's rows at column 0): per key, lane l is the chain of fused
// multiply-adds over d = l, l + L, ... and the lanes are added by lane_tree's halving tree, written
// out as ((0+8)+(4+12)) + ((2+10)+(6+14)) for even lanes and the same for odd ones. Vectorised
// over query rows instead of lanes, so no horizontal sums; the same bits as dot_key / dot_block.
// softmax_portable on 16 keys per vector: the same operations on every element, and its sum
// tree (j + (j + 16), then + 8, + 4, + 2, + 1) as halves of a register.
X512 ALWAYS_INLINE void softmax_avx512(const Problem& P, float* __restrict sr, i64 lo, i64 hi, i64 nk, float& m,
                                       float& l, float* __restrict ar, i64 Dp) {
    static_assert(BK == 2 * L, "two vectors per block");
    __m512 x[2];
    if (P.softcap > 0.f) {
        alignas(64) float t[BK];
        for (int j = 0; j < BK; ++j) t[j] = P.softcap * tanh_fixed(sr[j] * P.scale / P.softcap);
        x[0] = _mm512_load_ps(t), x[1] = _mm512_load_ps(t + L);
    } else {
        x[0] = _mm512_mul_ps(_mm512_loadu_ps(sr), _mm512_set1_ps(P.scale));
        x[1] = _mm512_mul_ps(_mm512_loadu_ps(sr + L), _mm512_set1_ps(P.scale));
    }
    const __m512i jlo = _mm512_set1_epi32(static_cast<i32>(std::max<i64>(lo, 0)));
    const __m512i jhi = _mm512_set1_epi32(static_cast<i32>(std::min<i64>(hi, nk - 1)));
    const __m512 ninf = _mm512_set1_ps(NEG_INF);
    for (int v = 0; v < 2; ++v) {
        const __m512i j = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(v * L));
        const __mmask16 keep = _mm512_cmp_epi32_mask(j, jlo, _MM_CMPINT_NLT) & _mm512_cmp_epi32_mask(j, jhi, _MM_CMPINT_LE);
        x[v] = _mm512_mask_mov_ps(ninf, keep, x[v]);
    }
    const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(x[0], x[1])));  // max: exact in any order
    const float alpha = m == NEG_INF ? 0.f : exp_neg(m - m_new);
    __m512 e[2];
    for (int v = 0; v < 2; ++v) {
        const __mmask16 masked = _mm512_cmp_ps_mask(x[v], ninf, _CMP_EQ_OQ);
        e[v] = _mm512_mask_mov_ps(exp_neg16(_mm512_sub_ps(x[v], _mm512_set1_ps(m_new))), masked, _mm512_setzero_ps());
        _mm512_storeu_ps(sr + v * L, e[v]);
    }
    const __m512 s16 = _mm512_add_ps(e[0], e[1]);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16), _mm512_extractf32x8_ps(s16, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const float sum = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    l = l * alpha + sum;
    m = m_new;
    const __m512 a = _mm512_set1_ps(alpha);
    for (i64 d = 0; d < Dp; d += L) _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), a));
}

template <int DT, int NC>
X512 void scores_avx512(const Problem& P, const i64* rows, i64 nk, i64 h, const float* qb, const i64* rl, i64 nr,
                        float* sc, const i64* next, i64 nn) {
    const i64 D = P.D, Dp = NC * L;
    for (i64 j = 0; j < nk; ++j) {
        if (j < nn) prefetch_row<DT>(P.k, (next[j] * P.Hkv + h) * D, D);
        __m512 kc[NC];
        load_row<DT, NC>(P.k, (rows[j] * P.Hkv + h) * D, D, kc);
        for (i64 i0 = 0; i0 < nr; i0 += 4) {  // four rows per reduction
            __m512 p[4];
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g) {
                p[g] = _mm512_setzero_ps();
                if (i0 + g < nr) {
                    const float* q = qb + rl[i0 + g] * Dp;
#pragma GCC unroll 16
                    for (int c = 0; c < NC; ++c) p[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * L), kc[c], p[g]);
                }
            }
            alignas(64) float lanes[L];
            _mm512_store_ps(lanes, lane_tree4(p[0], p[1], p[2], p[3]));
#pragma GCC unroll 4
            for (int g = 0; g < 4; ++g)
                if (i0 + g < nr) sc[rl[i0 + g] * BK + j] = lanes[4 * g];
        }
    }
}

// Decode scores for head dims up to 64: four keys at a time, in registers, and for each row one
// lane_tree4 over its four keys (the per-key path spends one tree per key on up to four rows, a
// quarter of it idle for SmolLM2's 3 rows per KV head). The same arithmetic per score, more of it
// independent in flight.
template <int DT, int NC>
X512 void scores_keys4_avx512(const Problem& P, const i64* rows, i64 nk, i64 h, const float* qb, const i64* rl,
                              i64 nr, float* sc, const i64* next, i64 nn) {
    static_assert(NC <= 4, "four keys of NC chunks must fit in registers");
    const i64 D = P.D, Dp = NC * L;
    i64 j = 0;
    for (; j + 4 <= nk; j += 4) {
        __m512 kc[4][NC];
#pragma GCC unroll 4
        for (int kk = 0; kk < 4; ++kk) {
            if (j + kk < nn) prefetch_row<DT>(P.k, (next[j + kk] * P.Hkv + h) * D, D);
            load_row<DT, NC>(P.k, (rows[j + kk] * P.Hkv + h) * D, D, kc[kk]);
        }
        for (i64 g = 0; g < nr; ++g) {
            const float* q = qb + rl[g] * Dp;
            __m512 p[4];
#pragma GCC unroll 4
            for (int kk = 0; kk < 4; ++kk) {
                p[kk] = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int c = 0; c < NC; ++c) p[kk] = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * L), kc[kk][c], p[kk]);
            }
            alignas(64) float lanes[L];
            _mm512_store_ps(lanes, lane_tree4(p[0], p[1], p[2], p[3]));
            float* out = sc + rl[g] * BK + j;
            out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
        }
    }
    if (j < nk) {  // the last keys of a short block: per key
        const i64 nn_left = std::max<i64>(0, nn - j);
        scores_avx512<DT, NC>(P, rows + j, nk - j, h, qb, rl, nr, sc + j, next + j, nn_left);
    }
}

template <int DT, int NC>
X512 void values_avx512(const Problem& P, const i64* rows, i64 nk, i64 h, const float* sc, const i64* rl, i64 nr,
                        float* acc, float* vbuf, const i64* next, i64 nn) {
    for (i64 j = 0; j < nn; ++j) prefetch_row<DT>(P.v, (next[j] * P.Hkv + h) * D_of(P), D_of(P));
    // groups of GR rows whose accumulators stay in registers over the block's keys; each value row
    // is loaded once per group, so with several groups a bf16/fp16 block is converted to fp32 once
    constexpr int GR = NC <= 4 ? 4 : NC <= 8 ? 2 : 1;
    if constexpr (DT != F32) {
        if (nr > GR) {
            for (i64 j = 0; j < nk; ++j) {
                __m512 r[NC];
                load_row<DT, NC>(P.v, (rows[j] * P.Hkv + h) * P.D, P.D, r);
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vbuf + j * NC * L + c * L, r[c]);
            }
            static const i64 seq_rows[BK] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                             16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
            Problem F = P;  // the converted block: fp32 rows of one head
            F.v = vbuf, F.Hkv = 1, F.D = NC * L;
            return values_avx512<F32, NC>(F, seq_rows, nk, 0, sc, rl, nr, acc, nullptr, nullptr, 0);
        }
    }
    const i64 D = P.D, Dp = NC * L;
    for (i64 i0 = 0; i0 < nr; i0 += GR) {
        const i64 ng = std::min<i64>(GR, nr - i0);
        __m512 a[GR][NC];
#pragma GCC unroll 4
        for (int g = 0; g < GR; ++g)
#pragma GCC unroll 16
            for (int c = 0; c < NC; ++c)
                a[g][c] = g < ng ? _mm512_loadu_ps(acc + rl[i0 + g] * Dp + c * L) : _mm512_setzero_ps();
        for (i64 j = 0; j < nk; ++j) {
            float pj[GR];
            bool any = false;
#pragma GCC unroll 4
            for (int g = 0; g < GR; ++g) {
                pj[g] = g < ng ? sc[rl[i0 + g] * BK + j] : 0.f;
                any = any || pj[g] != 0.f;
            }
            if (!any) continue;
            __m512 vc[NC];
            load_row<DT, NC>(P.v, (rows[j] * P.Hkv + h) * D, D, vc);
#pragma GCC unroll 4
            for (int g = 0; g < GR; ++g) {
                if (pj[g] == 0.f) continue;  // as the portable path: a zero weight adds nothing
                const __m512 pv = _mm512_set1_ps(pj[g]);
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pv, vc[c], a[g][c]);
            }
        }
#pragma GCC unroll 4
        for (int g = 0; g < GR; ++g)
            if (g < ng)
#pragma GCC unroll 16
                for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + rl[i0 + g] * Dp + c * L, a[g][c]);
    }
}

#define NOPAD_CHUNKS(F, ...)                                                                             \
    switch ((P.D + L - 1) / L) {                                                                         \
        case 1: return F<DT, 1>(__VA_ARGS__);  case 2: return F<DT, 2>(__VA_ARGS__);                    \
        case 3: return F<DT, 3>(__VA_ARGS__);  case 4: return F<DT, 4>(__VA_ARGS__);                    \
        case 5: return F<DT, 5>(__VA_ARGS__);  case 6: return F<DT, 6>(__VA_ARGS__);                    \
        case 7: return F<DT, 7>(__VA_ARGS__);  case 8: return F<DT, 8>(__VA_ARGS__);                    \
        case 9: return F<DT, 9>(__VA_ARGS__);  case 10: return F<DT, 10>(__VA_ARGS__);                  \
        case 11: return F<DT, 11>(__VA_ARGS__); case 12: return F<DT, 12>(__VA_ARGS__);                 \
        case 13: return F<DT, 13>(__VA_ARGS__); case 14: return F<DT, 14>(__VA_ARGS__);                 \
        case 15: return F<DT, 15>(__VA_ARGS__); default: return F<DT, 16>(__VA_ARGS__);                 \
    }

template <int DT>
struct Avx512Ops {
    X512 static void softmax(const Problem& P, float* sr, i64 lo, i64 hi, i64 nk, float& m, float& l, float* ar,
                             i64 Dp) {
        softmax_avx512(P, sr, lo, hi, nk, m, l, ar, Dp);
    }
    X512 static void scores(const Problem& P, const i64* rows, i64 nk, i64 h, const float* qb, const i64* rl,
                            i64 nr, float* sc, float*, const i64* next, i64 nn) {
        switch ((P.D + L - 1) / L) {
            case 1: return scores_keys4_avx512<DT, 1>(P, rows, nk, h, qb, rl, nr, sc, next, nn);
            case 2: return scores_keys4_avx512<DT, 2>(P, rows, nk, h, qb, rl, nr, sc, next, nn);
            case 3: return scores_keys4_avx512<DT, 3>(P, rows, nk, h, qb, rl, nr, sc, next, nn);
            case 4: return scores_keys4_avx512<DT, 4>(P, rows, nk, h, qb, rl, nr, sc, next, nn);
            default: break;
        }
        NOPAD_CHUNKS(scores_avx512, P, rows, nk, h, qb, rl, nr, sc, next, nn)
    }
    X512 static void values(const Problem& P, const i64* rows, i64 nk, i64 h, const float* sc, const i64* rl,
                            i64 nr, float* acc, float* vbuf, const i64* next, i64 nn) {
        NOPAD_CHUNKS(values_avx512, P, rows, nk, h, sc, rl, nr, acc, vbuf, next, nn)
    }
};
#endif

// Query rows of one head at least this many: the rows path (AVX-512: attend_item_rows; portable:
// transpose the head's block once and score it with dot_block); fewer (decode): score each key in
// place with dot_key. A speed choice only.
constexpr i64 TRANSPOSE_ROWS = 16;

// The cache rows of keys key0 .. key0 + n - 1 of sequence seq (paged: walking the block table
// without a division per key).
ALWAYS_INLINE void key_rows(const Problem& P, i64 seq, i64 key0, i64 n, i64* rows) {
    if (P.table) {
        i64 page = key0 / P.block_size, off = key0 % P.block_size;
        const i32* trow = P.table + seq * P.table_width;
        for (i64 j = 0; j < n; ++j) {
            rows[j] = static_cast<i64>(trow[page]) * P.block_size + off;
            if (++off == P.block_size) off = 0, ++page;
        }
    } else {
        for (i64 j = 0; j < n; ++j) rows[j] = P.k_start[seq] + key0 + j;
    }
}

// Ask for the K and V rows (every KV head) of the first block an item reads, one block before it
// runs: within an item each block's rows are prefetched while the block before computes, but the
// pages of a paged cache lie anywhere, so nothing else fetches an item's first block early.
// A speed hint only.
template <int DT>
ALWAYS_INLINE void prefetch_first_block(const Problem& P, const Item& it, i64* rows) {
    const i64 klen = P.lens_k[it.seq];
    const i64 pos = klen - (P.cu_q[it.seq + 1] - P.cu_q[it.seq]) + it.t0;  // its first query's position
    const i64 key0 = P.window > 0 ? std::max<i64>(0, pos - P.window + 1) / BK * BK : 0;
    const i64 n = std::min<i64>(BK, klen - key0);
    key_rows(P, it.seq, key0, n, rows);
    const i64 row_bytes = P.Hkv * P.D * (DT == F32 ? 4 : 2);
    for (i64 j = 0; j < n;) {
        i64 e = j + 1;
        while (e < n && rows[e] == rows[e - 1] + 1) ++e;  // adjacent rows: one span of memory
        const i64 bytes = (e - j) * row_bytes;
        for (const void* base : {P.k, P.v}) {
            const char* p = static_cast<const char*>(base) + rows[j] * row_bytes;
            for (i64 c = 0; c < bytes + 63; c += 64) __builtin_prefetch(p + std::min(c, bytes - 1), 0, 2);
        }
        j = e;
    }
}

// upcoming: the item this thread runs next (its first block is prefetched during this item's last).
template <int DT, class Ops>
ALWAYS_INLINE void attend_body(const Problem& P, const Item& it, Scratch& S, const Item* upcoming) {
    const i64 H = P.H, Hkv = P.Hkv, G = H / Hkv, D = P.D, Dp = (D + L - 1) / L * L;
    const i64 qlen = P.cu_q[it.seq + 1] - P.cu_q[it.seq];
    const i64 klen = P.lens_k[it.seq];
    const i64 R = it.nt * H;
    float* __restrict qb = S.q.data();
    float* __restrict acc = S.acc.data();
    float* __restrict sc = S.s.data();
    i64* lo = S.lo.data();
    i64* hi = S.hi.data();
    i64* rows = S.rows.data();
    char* active = S.active.data();
    i64 first_block = std::numeric_limits<i64>::max(), last_block = -1;
    for (i64 t = 0; t < it.nt; ++t) {
        const i64 token = P.cu_q[it.seq] + it.t0 + t;
        const i64 pos = klen - qlen + it.t0 + t;  // the query's position among its keys
        const i64 top = P.causal ? pos : klen - 1;
        const i64 bottom = P.window > 0 ? std::max<i64>(0, pos - P.window + 1) : 0;
        for (i64 head = 0; head < H; ++head) {
            const i64 r = t * H + head;
            for (i64 d = 0; d < D; ++d) qb[r * Dp + d] = load<DT>(P.q, (token * H + head) * D + d);
            for (i64 d = D; d < Dp; ++d) qb[r * Dp + d] = 0.f;
            lo[r] = bottom;
            hi[r] = top;
            S.m[r] = NEG_INF;
            S.l[r] = 0.f;
            std::fill(acc + r * Dp, acc + (r + 1) * Dp, 0.f);
        }
        first_block = std::min(first_block, bottom / BK);
        last_block = std::max(last_block, top / BK);
    }
    const i64 row_stride = Hkv * D;
    const i64 lists = QT * G + 1;  // per KV head: [count, rows...] of its rows active in this block
    i64* heads_rows = S.vrows.data();
    for (i64 b = first_block; b <= last_block; ++b) {
        const i64 key0 = b * BK;
        const i64 nk = std::min<i64>(BK, klen - key0);
        if (b == last_block && upcoming) prefetch_first_block<DT>(P, *upcoming, S.rows.data() + BK);
        key_rows(P, it.seq, key0, nk, rows);
        i64* next = S.rows.data() + BK;  // the next block's rows: prefetched while this one computes
        const i64 nn = b < last_block ? std::min<i64>(BK, klen - key0 - BK) : 0;
        key_rows(P, it.seq, key0 + BK, nn, next);
        for (i64 r = 0; r < R; ++r) active[r] = b >= lo[r] / BK && b <= hi[r] / BK;  // a row's own blocks
        bool few = true;  // every head's active rows few: score key by key, K read in place
        for (i64 h = 0; h < Hkv; ++h) {
            i64* hr = heads_rows + h * lists;
            hr[0] = 0;
            for (i64 t = 0; t < it.nt; ++t)
                for (i64 g = 0; g < G; ++g)
                    if (active[t * H + h * G + g]) hr[1 + hr[0]++] = t * H + h * G + g;
            few = few && hr[0] < TRANSPOSE_ROWS;
        }
        // scores
        if (few) {
            for (i64 h = 0; h < Hkv; ++h) {
                const i64* hr = heads_rows + h * lists;
                if (hr[0]) Ops::scores(P, rows, nk, h, qb, hr + 1, hr[0], sc, S.kbuf.data(), next, nn);
            }
        } else {
            for (i64 h = 0; h < Hkv; ++h) {
                const i64* hr = heads_rows + h * lists;
                if (!hr[0]) continue;
                float* kt = S.kt.data();
                for (i64 j = 0; j < BK; ++j) {
                    if (j < nk) {
                        const i64 base = rows[j] * row_stride + h * D;
                        for (i64 d = 0; d < D; ++d) kt[d * BK + j] = load<DT>(P.k, base + d);
                        for (i64 d = D; d < Dp; ++d) kt[d * BK + j] = 0.f;
                    } else {
                        for (i64 d = 0; d < Dp; ++d) kt[d * BK + j] = 0.f;
                    }
                }
                for (i64 i = 0; i < hr[0]; ++i)
                    dot_block(qb + hr[1 + i] * Dp, kt, S.lanes.data(), sc + hr[1 + i] * BK, Dp);
            }
        }
        // online softmax, per row
        for (i64 r = 0; r < R; ++r)
            if (active[r]) Ops::softmax(P, sc + r * BK, lo[r] - key0, hi[r] - key0, nk, S.m[r], S.l[r], acc + r * Dp, Dp);
        // values: each row adds p * v over the block's keys in order
        for (i64 h = 0; h < Hkv; ++h) {
            const i64* hr = heads_rows + h * lists;
            if (hr[0]) Ops::values(P, rows, nk, h, sc, hr + 1, hr[0], acc, S.vbuf.data(), next, nn);
        }
    }
    for (i64 t = 0; t < it.nt; ++t) {
        const i64 token = P.cu_q[it.seq] + it.t0 + t;
        for (i64 head = 0; head < H; ++head) {
            const i64 r = t * H + head;
            const float inv = 1.f / denominator(P, head, S.m[r], S.l[r]);
            for (i64 d = 0; d < D; ++d) store<DT>(P.out, (token * H + head) * D + d, acc[r * Dp + d] * inv);
        }
    }
}

#if defined(__x86_64__)
template <int NC, int KB>  // lane l's chain for KB keys
X512 ALWAYS_INLINE void lane_chain(const float* __restrict qt, i64 Rh, const float* __restrict kf, i64 Dp, int l,
                                   __m512* p) {
#pragma GCC unroll 4
    for (int kk = 0; kk < KB; ++kk) p[kk] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
        const __m512 qv = _mm512_loadu_ps(qt + (c * L + l) * Rh);
#pragma GCC unroll 4
        for (int kk = 0; kk < KB; ++kk) p[kk] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[kk * Dp + c * L + l]), p[kk]);
    }
}

// lanes l, l + S, summed; with S = 8 a pair, then recursively (l, l + 4) pairs of pairs, ...
template <int NC, int KB, int S>
X512 ALWAYS_INLINE void lane_sum(const float* __restrict qt, i64 Rh, const float* __restrict kf, i64 Dp, int l,
                                 __m512* s) {
    __m512 a[KB], b[KB];
    if constexpr (S == 8) {
        lane_chain<NC, KB>(qt, Rh, kf, Dp, l, a);
        lane_chain<NC, KB>(qt, Rh, kf, Dp, l + 8, b);
    } else {
        lane_sum<NC, KB, S * 2>(qt, Rh, kf, Dp, l, a);
        lane_sum<NC, KB, S * 2>(qt, Rh, kf, Dp, l + S, b);
    }
#pragma GCC unroll 4
    for (int kk = 0; kk < KB; ++kk) s[kk] = _mm512_add_ps(a[kk], b[kk]);
}

// Scores of KB keys (fp32 rows kf, Dp apart) for 16 query rows at once (qt: the head's queries
// transposed, [Dp][Rh], this vector's rows at column 0). Per key, lane l is the chain of fused
// multiply-adds over d = l, l + L, ..., and the lanes are added by lane_tree's halving tree:
// lane_sum<., ., 1>(0) = ((0+8)+(4+12)) + ((2+10)+(6+14)) + (the same from lane 1). Vectorised
// over query rows instead of lanes, so no horizontal sums; the same bits as dot_key / dot_block.
template <int NC, int KB>
X512 ALWAYS_INLINE void scores_rows16(const float* __restrict qt, i64 Rh, const float* __restrict kf, i64 Dp,
                                      float* __restrict out, i64 out_stride) {
    __m512 s[KB];
    lane_sum<NC, KB, 1>(qt, Rh, kf, Dp, 0, s);
#pragma GCC unroll 4
    for (int kk = 0; kk < KB; ++kk) _mm512_storeu_ps(out + kk * out_stride, s[kk]);
}

// A work item with many query rows per KV head (prefill chunks, training rows), head by head: the
// head's queries are transposed once, each key block is converted to fp32 once, scores and the
// online softmax run 16 query rows per vector, and p * v is added key by key in order. Every sum
// is the one attend_body does (so the same bits); padding rows are masked out (an all-masked
// block leaves a row's state unchanged: alpha is exactly 1, or 0 on an all-zero state).
template <int DT, int NC>
X512 void attend_item_rows_avx512(const Problem& P, const Item& it, Scratch& S) {
    const i64 H = P.H, Hkv = P.Hkv, G = H / Hkv, D = P.D, Dp = NC * L;
    const i64 qlen = P.cu_q[it.seq + 1] - P.cu_q[it.seq];
    const i64 klen = P.lens_k[it.seq];
    const i64 n = it.nt * G, Rh = (n + L - 1) / L * L, NV = Rh / L;
    float* __restrict qt = S.q.data();    // [Dp][Rh]
    float* __restrict acc = S.acc.data();  // [Rh][Dp]
    float* __restrict st = S.s.data();     // [BK][Rh]
    float* __restrict kf = S.kt.data();    // [BK][Dp]
    float* __restrict vf = S.kt.data() + BK * Dp;
    float* __restrict m = S.m.data();
    float* __restrict l = S.l.data();
    float* __restrict alpha = S.lanes.data();
    i32* lo = S.lo32.data();
    i32* hi = S.hi32.data();
    i64 first_block = std::numeric_limits<i64>::max(), last_block = -1;
    for (i64 i = 0; i < Rh; ++i) {
        if (i < n) {
            const i64 pos = klen - qlen + it.t0 + i / G;
            hi[i] = static_cast<i32>(P.causal ? pos : klen - 1);
            lo[i] = static_cast<i32>(P.window > 0 ? std::max<i64>(0, pos - P.window + 1) : 0);
            first_block = std::min<i64>(first_block, lo[i] / BK);
            last_block = std::max<i64>(last_block, hi[i] / BK);
        } else {
            lo[i] = 1, hi[i] = 0;  // a padding row sees no key
        }
    }
    i64 rows[2 * BK];
    for (i64 h = 0; h < Hkv; ++h) {
        for (i64 i = 0; i < Rh; ++i) {
            const i64 token = P.cu_q[it.seq] + it.t0 + i / G;
            const i64 off = (token * H + h * G + i % G) * D;
            for (i64 d = 0; d < Dp; ++d) qt[d * Rh + i] = i < n && d < D ? load<DT>(P.q, off + d) : 0.f;
            m[i] = NEG_INF;
            l[i] = 0.f;
            std::fill(acc + i * Dp, acc + (i + 1) * Dp, 0.f);
        }
        for (i64 b = first_block; b <= last_block; ++b) {
            const i64 key0 = b * BK, nk = std::min<i64>(BK, klen - key0);
            key_rows(P, it.seq, key0, nk, rows);
            const i64 nn = b < last_block ? std::min<i64>(BK, klen - key0 - BK) : 0;
            key_rows(P, it.seq, key0 + BK, nn, rows + BK);
            for (i64 j = 0; j < nn; ++j) {
                prefetch_row<DT>(P.k, (rows[BK + j] * Hkv + h) * D, D);
                prefetch_row<DT>(P.v, (rows[BK + j] * Hkv + h) * D, D);
            }
            for (i64 j = 0; j < nk; ++j) {
                __m512 r[NC];
                load_row<DT, NC>(P.k, (rows[j] * Hkv + h) * D, D, r);
                for (int c = 0; c < NC; ++c) _mm512_storeu_ps(kf + j * Dp + c * L, r[c]);
                load_row<DT, NC>(P.v, (rows[j] * Hkv + h) * D, D, r);
                for (int c = 0; c < NC; ++c) _mm512_storeu_ps(vf + j * Dp + c * L, r[c]);
            }
            // scores, [BK][Rh]; keys past nk are masked below
            for (i64 vi = 0; vi < NV; ++vi) {
                i64 j = 0;
                for (; j + 4 <= nk; j += 4) scores_rows16<NC, 4>(qt + vi * L, Rh, kf + j * Dp, Dp, st + j * Rh + vi * L, Rh);
                for (; j < nk; ++j) scores_rows16<NC, 1>(qt + vi * L, Rh, kf + j * Dp, Dp, st + j * Rh + vi * L, Rh);
            }
            // online softmax, 16 rows per vector
            for (i64 vi = 0; vi < NV; ++vi) {
                const __m512i jlo = _mm512_max_epi32(_mm512_sub_epi32(_mm512_loadu_si512(lo + vi * L),
                                                                      _mm512_set1_epi32(static_cast<i32>(key0))),
                                                     _mm512_setzero_si512());
                const __m512i jhi = _mm512_min_epi32(_mm512_sub_epi32(_mm512_loadu_si512(hi + vi * L),
                                                                      _mm512_set1_epi32(static_cast<i32>(key0))),
                                                     _mm512_set1_epi32(static_cast<i32>(nk - 1)));
                __m512 x[BK];
                for (int j = 0; j < BK; ++j) {
                    float* sj = st + j * Rh + vi * L;
                    if (P.softcap > 0.f) {
                        alignas(64) float tmp[L];
                        for (int e = 0; e < L; ++e) tmp[e] = j < nk ? P.softcap * tanh_fixed(sj[e] * P.scale / P.softcap) : 0.f;
                        x[j] = _mm512_load_ps(tmp);
                    } else {
                        x[j] = j < nk ? _mm512_mul_ps(_mm512_loadu_ps(sj), _mm512_set1_ps(P.scale)) : _mm512_setzero_ps();
                    }
                    const __m512i jv = _mm512_set1_epi32(j);
                    const __mmask16 keep = _mm512_cmp_epi32_mask(jv, jlo, _MM_CMPINT_NLT) &
                                           _mm512_cmp_epi32_mask(jv, jhi, _MM_CMPINT_LE);
                    x[j] = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), keep, x[j]);
                }
                __m512 mx[BK / 2];
                for (int j = 0; j < BK / 2; ++j) mx[j] = _mm512_max_ps(x[j], x[j + BK / 2]);
                for (int w = BK / 4; w >= 1; w /= 2)
                    for (int j = 0; j < w; ++j) mx[j] = _mm512_max_ps(mx[j], mx[j + w]);
                const __m512 m_old = _mm512_loadu_ps(m + vi * L);
                const __m512 m_new = _mm512_max_ps(m_old, mx[0]);
                const __mmask16 fresh = _mm512_cmp_ps_mask(m_old, _mm512_set1_ps(NEG_INF), _CMP_EQ_OQ);
                const __m512 a = _mm512_mask_mov_ps(exp_neg16(_mm512_sub_ps(m_old, m_new)), fresh, _mm512_setzero_ps());
                __m512 e[BK];
                for (int j = 0; j < BK; ++j) {
                    const __mmask16 masked = _mm512_cmp_ps_mask(x[j], _mm512_set1_ps(NEG_INF), _CMP_EQ_OQ);
                    e[j] = _mm512_mask_mov_ps(exp_neg16(_mm512_sub_ps(x[j], m_new)), masked, _mm512_setzero_ps());
                    _mm512_storeu_ps(st + j * Rh + vi * L, e[j]);
                }
                __m512 p[BK / 2];
                for (int j = 0; j < BK / 2; ++j) p[j] = _mm512_add_ps(e[j], e[j + BK / 2]);
                for (int w = BK / 4; w >= 1; w /= 2)
                    for (int j = 0; j < w; ++j) p[j] = _mm512_add_ps(p[j], p[j + w]);
                _mm512_storeu_ps(l + vi * L, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(l + vi * L), a), p[0]));
                _mm512_storeu_ps(m + vi * L, m_new);
                _mm512_storeu_ps(alpha + vi * L, a);
            }
            // values: GR rows' accumulators in registers over the block's keys, in key order
            constexpr int GR = NC <= 4 ? 4 : NC <= 8 ? 2 : 1;
            for (i64 i0 = 0; i0 < n; i0 += GR) {
                const i64 ng = std::min<i64>(GR, n - i0);
                __m512 av[GR][NC];
#pragma GCC unroll 4
                for (int g = 0; g < GR; ++g) {
                    const __m512 ag = _mm512_set1_ps(g < ng ? alpha[i0 + g] : 0.f);
#pragma GCC unroll 16
                    for (int c = 0; c < NC; ++c)
                        av[g][c] = g < ng ? _mm512_mul_ps(_mm512_loadu_ps(acc + (i0 + g) * Dp + c * L), ag)
                                          : _mm512_setzero_ps();
                }
                for (i64 j = 0; j < nk; ++j) {
                    const float* pj = st + j * Rh + i0;
                    bool any = false;
#pragma GCC unroll 4
                    for (int g = 0; g < GR; ++g) any = any || (g < ng && pj[g] != 0.f);
                    if (!any) continue;
                    const float* vj = vf + j * Dp;
#pragma GCC unroll 4
                    for (int g = 0; g < GR; ++g) {
                        if (g >= ng || pj[g] == 0.f) continue;  // a zero weight adds nothing
                        const __m512 pv = _mm512_set1_ps(pj[g]);
#pragma GCC unroll 16
                        for (int c = 0; c < NC; ++c) av[g][c] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vj + c * L), av[g][c]);
                    }
                }
#pragma GCC unroll 4
                for (int g = 0; g < GR; ++g)
                    if (g < ng)
#pragma GCC unroll 16
                        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + (i0 + g) * Dp + c * L, av[g][c]);
            }
        }
        for (i64 i = 0; i < n; ++i) {
            const i64 token = P.cu_q[it.seq] + it.t0 + i / G;
            const float inv = 1.f / denominator(P, h * G + i % G, m[i], l[i]);
            const i64 off = (token * H + h * G + i % G) * D;
            for (i64 d = 0; d < D; ++d) store<DT>(P.out, off + d, acc[i * Dp + d] * inv);
        }
    }
}

template <int DT>
X512 void attend_item_rows(const Problem& P, const Item& it, Scratch& S) {
    NOPAD_CHUNKS(attend_item_rows_avx512, P, it, S)
}
#endif

template <int DT>
__attribute__((target_clones("arch=x86-64-v3", "default")))
void attend_item_portable(const Problem& P, const Item& it, Scratch& S, const Item* upcoming) {
    attend_body<DT, PortableOps<DT>>(P, it, S, upcoming);
}

#if defined(__x86_64__)
template <int DT>
X512 void attend_item_avx512(const Problem& P, const Item& it, Scratch& S, const Item* upcoming) {
    attend_body<DT, Avx512Ops<DT>>(P, it, S, upcoming);
}
const bool supports_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
const bool supports_avx512 = false;
#endif
bool use_avx512 = supports_avx512;

template <int DT>
void run(const Problem& P, i64 num_seqs, int threads) {
    std::vector<Item> items;
    for (i64 i = 0; i < num_seqs; ++i) {
        const i64 qlen = P.cu_q[i + 1] - P.cu_q[i];
        for (i64 t0 = 0; t0 < qlen; t0 += QT) items.push_back({i, t0, std::min<i64>(QT, qlen - t0)});
    }
    // longest work first (late query tiles of long sequences see the most keys)
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
        const i64 ka = P.lens_k[a.seq] - (P.cu_q[a.seq + 1] - P.cu_q[a.seq]) + a.t0;
        const i64 kb = P.lens_k[b.seq] - (P.cu_q[b.seq + 1] - P.cu_q[b.seq]) + b.t0;
        return ka > kb;
    });
    const i64 Dp = (P.D + L - 1) / L * L, R = QT * P.H;
    const i64 n = static_cast<i64>(items.size());
    // each thread claims its next item when it starts one (dynamic scheduling, one item ahead), so
    // it can fetch that item's first keys while it still computes
    std::atomic<i64> claimed{0};
#pragma omp parallel num_threads(static_cast<int>(std::max<i64>(1, std::min<i64>(threads, n))))
    {
        Scratch scratch(R, Dp, P.H);
        i64 w = claimed++;
        if (w < n) prefetch_first_block<DT>(P, items[w], scratch.rows.data());
        while (w < n) {
            const i64 after = claimed++;
            const Item* upcoming = after < n ? &items[after] : nullptr;
#if defined(__x86_64__)
            const bool many_rows = items[w].nt * (P.H / P.Hkv) >= TRANSPOSE_ROWS;
            if (use_avx512 && many_rows) attend_item_rows<DT>(P, items[w], scratch);
            else if (use_avx512) attend_item_avx512<DT>(P, items[w], scratch, upcoming);
            else
#endif
                attend_item_portable<DT>(P, items[w], scratch, upcoming);
            w = after;
        }
    }
}

using iarray = py::array_t<i32, py::array::c_style | py::array::forcecast>;
using larray = py::array_t<i64, py::array::c_style | py::array::forcecast>;
using farray = py::array_t<float, py::array::c_style | py::array::forcecast>;

void forward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, int dtype, i64 key_rows, iarray cu_q,
             iarray lens_k, py::object k_start, py::object table, i64 block_size, i64 H, i64 Hkv, i64 D,
             double scale, double softcap, i64 window, bool causal, int threads, py::object sinks) {
    const i64 num_seqs = lens_k.size();
    if (cu_q.size() != num_seqs + 1) throw std::invalid_argument("cu_q must have num_seqs + 1 entries");
    for (i64 i = 0; i < num_seqs; ++i)
        if (cu_q.data()[i + 1] - cu_q.data()[i] > lens_k.data()[i] || cu_q.data()[i + 1] < cu_q.data()[i])
            throw std::invalid_argument("a sequence has more queries than keys");
    if (H % Hkv) throw std::invalid_argument("query heads must be a multiple of kv heads");
    if (D < 1 || D > MAX_D) throw std::invalid_argument("head dim must be in [1, 256]");
    larray starts;
    iarray tab;
    Problem P{};
    P.q = reinterpret_cast<const void*>(q);
    P.k = reinterpret_cast<const void*>(k);
    P.v = reinterpret_cast<const void*>(v);
    P.out = reinterpret_cast<void*>(out);
    P.cu_q = cu_q.data();
    P.lens_k = lens_k.data();
    if (!table.is_none()) {
        tab = table.cast<iarray>();
        if (tab.ndim() != 2 || tab.shape(0) != num_seqs) throw std::invalid_argument("table must be [num_seqs, w]");
        P.table = tab.data();
        P.table_width = tab.shape(1);
        P.block_size = block_size;
        if (block_size < 1 || key_rows % block_size) throw std::invalid_argument("bad block size");
        for (i64 i = 0; i < num_seqs; ++i) {
            const i64 used = (lens_k.data()[i] + block_size - 1) / block_size;
            if (used > P.table_width) throw std::invalid_argument("block table too narrow for the keys");
            for (i64 b = 0; b < used; ++b) {
                const i32 id = P.table[i * P.table_width + b];
                if (id < 0 || id >= key_rows / block_size)
                    throw std::invalid_argument("block id out of range of the KV cache");
            }
        }
    } else {
        starts = k_start.cast<larray>();
        if (starts.size() != num_seqs) throw std::invalid_argument("k_start must have num_seqs entries");
        P.k_start = starts.data();
        for (i64 i = 0; i < num_seqs; ++i)
            if (P.k_start[i] < 0 || P.k_start[i] + lens_k.data()[i] > key_rows)
                throw std::invalid_argument("keys out of range of k/v");
    }
    P.H = H, P.Hkv = Hkv, P.D = D;
    P.scale = static_cast<float>(scale);
    P.softcap = static_cast<float>(softcap);
    P.window = window;
    P.causal = causal;
    farray sink_values;
    if (!sinks.is_none()) {
        sink_values = sinks.cast<farray>();
        if (sink_values.size() != H) throw std::invalid_argument("sinks must have one value per query head");
        P.sinks = sink_values.data();
    }
    py::gil_scoped_release release;
    if (dtype == F32) run<F32>(P, num_seqs, threads);
    else if (dtype == BF16) run<BF16>(P, num_seqs, threads);
    else if (dtype == F16) run<F16>(P, num_seqs, threads);
    else throw std::invalid_argument("dtype code must be 0 (fp32), 1 (bf16) or 2 (fp16)");
}

}  // namespace

PYBIND11_MODULE(_varlen_attention, m) {
    m.doc() = "Varlen attention forward on CPU with a fixed per-query reduction order (see csrc/).";
    m.attr("BLOCK_KEYS") = BK;
    m.def("forward", &forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("dtype"),
          py::arg("key_rows"), py::arg("cu_q"), py::arg("lens_k"), py::arg("k_start"), py::arg("table"), py::arg("block_size"),
          py::arg("H"), py::arg("Hkv"), py::arg("D"), py::arg("scale"), py::arg("softcap"), py::arg("window"),
          py::arg("causal"), py::arg("threads"), py::arg("sinks") = py::none());
    m.def("isa", [] { return use_avx512 ? "avx512" : "portable"; },
          "The code path forward runs on this CPU (both give the same bits).");
    m.def("set_portable", [](bool portable) {
        use_avx512 = !portable && supports_avx512;
    }, "Force the portable path (tests compare its bits with the AVX-512 path's).");
}
