// Varlen attention forward for CPU (`packing._varlen_attention`): one kernel for a packed training
// row, a chunk of a prompt and a decode token, with keys read in place from a flat row or from the
// blocks of a paged KV cache, in fp32, bf16 or fp16.
//
// Why one kernel: the generator and the trainer must compute every token's attention the same way
// for their log-probs to be bitwise equal (packing.batch_invariant). Here each query's result
// depends on nothing but its own keys: keys are visited in fixed blocks of BK, aligned to key 0,
// in order; inside a block, each score is a dot product summed over the head dimension in order;
// softmax is online across blocks, in fp32. Which other queries, sequences or threads share the
// call never changes the order of any sum. It is also the generation kernel of the default mode:
// no gather copy of cached keys for decode or for prefill chunks, and one call per layer.
//
// No torch at build time: the caller passes the data pointers of contiguous CPU tensors.
// Layout: q, out [total_q, H, D]; k, v [rows, Hkv, D] where key p of sequence i is row
// table[i, p / bs] * bs + p % bs (paged) or k_start[i] + p (flat); query head h uses KV head
// h / (H / Hkv). Causal masks align to the end of each sequence's keys (a decode token is the
// last key), sliding window W keeps keys p - W < key <= p.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using i32 = int32_t;
using i64 = int64_t;
using u16 = uint16_t;
using u32 = uint32_t;

namespace {

constexpr int BK = 32;  // keys per block: the fixed unit of every reduction over keys
constexpr int QT = 8;   // query tokens per work item (a scheduling choice; results do not depend on it)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

enum Dtype : int { F32 = 0, BF16 = 1, F16 = 2 };

inline float bf16_to_f32(u16 b) {
    u32 u = static_cast<u32>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline u16 f32_to_bf16(float f) {  // round to nearest even, as torch does
    u32 u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<u16>((u >> 16) | 0x40u);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<u16>(u >> 16);
}

template <int DT>
inline float load(const void* base, i64 i) {
    if constexpr (DT == F32) return static_cast<const float*>(base)[i];
    if constexpr (DT == BF16) return bf16_to_f32(static_cast<const u16*>(base)[i]);
    if constexpr (DT == F16) return static_cast<float>(static_cast<const _Float16*>(base)[i]);
}

template <int DT>
inline void store(void* base, i64 i, float x) {
    if constexpr (DT == F32) static_cast<float*>(base)[i] = x;
    if constexpr (DT == BF16) static_cast<u16*>(base)[i] = f32_to_bf16(x);
    if constexpr (DT == F16) static_cast<_Float16*>(base)[i] = static_cast<_Float16>(x);
}

// exp for x <= 0 (scores minus their running max): 2^n * 2^f, f in [-0.5, 0.5], degree-6
// polynomial. Plain arithmetic so it is the same code for every element of every call.
inline float exp_neg(float x) {
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

inline float tanh_fixed(float x) {  // tanh from exp_neg: 1 - 2 / (e^{2|x|} + 1), odd
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
};

struct Item {
    i64 seq, kv_head, t0, nt;
};

template <int DT>
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_item(const Problem& P, const Item& it, float* qbuf, float* acc, float* mrow, float* lrow,
                 i64* lo, i64* hi, float* kt, float* vb, float* s) {
    const i64 G = P.H / P.Hkv, D = P.D;
    const i64 qlen = P.cu_q[it.seq + 1] - P.cu_q[it.seq];
    const i64 klen = P.lens_k[it.seq];
    const i64 R = it.nt * G;  // query rows: (token, group head)
    i64 first_block = std::numeric_limits<i64>::max(), last_block = -1;
    for (i64 t = 0; t < it.nt; ++t) {
        const i64 token = P.cu_q[it.seq] + it.t0 + t;
        const i64 pos = klen - qlen + it.t0 + t;  // the query's position among its keys
        const i64 top = P.causal ? pos : klen - 1;
        const i64 bottom = P.window > 0 ? std::max<i64>(0, pos - P.window + 1) : 0;
        for (i64 g = 0; g < G; ++g) {
            const i64 r = t * G + g;
            const i64 head = it.kv_head * G + g;
            for (i64 d = 0; d < D; ++d) qbuf[r * D + d] = load<DT>(P.q, (token * P.H + head) * D + d);
            lo[r] = bottom;
            hi[r] = top;
            mrow[r] = NEG_INF;
            lrow[r] = 0.f;
            std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
        }
        first_block = std::min(first_block, bottom / BK);
        last_block = std::max(last_block, top / BK);
    }
    for (i64 b = first_block; b <= last_block; ++b) {
        // this block's keys and values, as fp32, keys transposed (d-major); missing keys are zero
        for (i64 j = 0; j < BK; ++j) {
            const i64 key = b * BK + j;
            if (key >= klen) {
                for (i64 d = 0; d < D; ++d) kt[d * BK + j] = 0.f;
                std::fill(vb + j * D, vb + (j + 1) * D, 0.f);
                continue;
            }
            const i64 row = P.table ? static_cast<i64>(P.table[it.seq * P.table_width + key / P.block_size]) *
                                              P.block_size + key % P.block_size
                                    : P.k_start[it.seq] + key;
            const i64 base = (row * P.Hkv + it.kv_head) * D;
            for (i64 d = 0; d < D; ++d) kt[d * BK + j] = load<DT>(P.k, base + d);
            for (i64 d = 0; d < D; ++d) vb[j * D + d] = load<DT>(P.v, base + d);
        }
        for (i64 r = 0; r < R; ++r) {
            if (b < lo[r] / BK || b > hi[r] / BK) continue;  // a row visits only its own blocks
            float* sr = s + r * BK;
            const float* qr = qbuf + r * D;
            for (i64 j = 0; j < BK; ++j) sr[j] = 0.f;
            for (i64 d = 0; d < D; ++d) {  // over d in order; vectorised across the block's keys
                const float qd = qr[d];
                const float* kd = kt + d * BK;
                for (i64 j = 0; j < BK; ++j) sr[j] += qd * kd[j];
            }
            float block_max = NEG_INF;
            for (i64 j = 0; j < BK; ++j) {
                const i64 key = b * BK + j;
                float x = sr[j] * P.scale;
                if (P.softcap > 0.f) x = P.softcap * tanh_fixed(x / P.softcap);
                const bool visible = key >= lo[r] && key <= hi[r] && key < klen;
                sr[j] = visible ? x : NEG_INF;
                block_max = std::max(block_max, sr[j]);
            }
            const float m_new = std::max(mrow[r], block_max);
            const float alpha = mrow[r] == NEG_INF ? 0.f : exp_neg(mrow[r] - m_new);
            float total = 0.f;
            for (i64 j = 0; j < BK; ++j) {
                sr[j] = sr[j] == NEG_INF ? 0.f : exp_neg(sr[j] - m_new);
                total += sr[j];
            }
            lrow[r] = lrow[r] * alpha + total;
            mrow[r] = m_new;
            float* ar = acc + r * D;
            for (i64 d = 0; d < D; ++d) ar[d] *= alpha;
            for (i64 j = 0; j < BK; ++j) {
                const float p = sr[j];
                if (p == 0.f) continue;
                const float* vj = vb + j * D;
                for (i64 d = 0; d < D; ++d) ar[d] += p * vj[d];
            }
        }
    }
    for (i64 t = 0; t < it.nt; ++t) {
        const i64 token = P.cu_q[it.seq] + it.t0 + t;
        for (i64 g = 0; g < G; ++g) {
            const i64 r = t * G + g;
            const i64 head = it.kv_head * G + g;
            const float inv = 1.f / lrow[r];
            for (i64 d = 0; d < D; ++d) store<DT>(P.out, (token * P.H + head) * D + d, acc[r * D + d] * inv);
        }
    }
}

template <int DT>
void run(const Problem& P, i64 num_seqs, int threads) {
    std::vector<Item> items;
    for (i64 i = 0; i < num_seqs; ++i) {
        const i64 qlen = P.cu_q[i + 1] - P.cu_q[i];
        for (i64 h = 0; h < P.Hkv; ++h)
            for (i64 t0 = 0; t0 < qlen; t0 += QT) items.push_back({i, h, t0, std::min<i64>(QT, qlen - t0)});
    }
    // longest work first (late query tiles of long sequences see the most keys)
    std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
        const i64 ka = P.lens_k[a.seq] - (P.cu_q[a.seq + 1] - P.cu_q[a.seq]) + a.t0;
        const i64 kb = P.lens_k[b.seq] - (P.cu_q[b.seq + 1] - P.cu_q[b.seq]) + b.t0;
        return ka > kb;
    });
    const i64 G = P.H / P.Hkv, D = P.D, R = QT * G;
    const i64 n = static_cast<i64>(items.size());
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> qbuf(R * D), acc(R * D), m(R), l(R), kt(D * BK), vb(BK * D), s(R * BK);
        std::vector<i64> lo(R), hi(R);
#pragma omp for schedule(dynamic, 1)
        for (i64 w = 0; w < n; ++w)
            attend_item<DT>(P, items[w], qbuf.data(), acc.data(), m.data(), l.data(), lo.data(), hi.data(),
                            kt.data(), vb.data(), s.data());
    }
}

using iarray = py::array_t<i32, py::array::c_style | py::array::forcecast>;
using larray = py::array_t<i64, py::array::c_style | py::array::forcecast>;

void forward(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t out, int dtype, i64 key_rows, iarray cu_q,
             iarray lens_k, py::object k_start, py::object table, i64 block_size, i64 H, i64 Hkv, i64 D,
             double scale, double softcap, i64 window, bool causal, int threads) {
    const i64 num_seqs = lens_k.size();
    if (cu_q.size() != num_seqs + 1) throw std::invalid_argument("cu_q must have num_seqs + 1 entries");
    for (i64 i = 0; i < num_seqs; ++i)
        if (cu_q.data()[i + 1] - cu_q.data()[i] > lens_k.data()[i] || cu_q.data()[i + 1] < cu_q.data()[i])
            throw std::invalid_argument("a sequence has more queries than keys");
    if (H % Hkv) throw std::invalid_argument("query heads must be a multiple of kv heads");
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
          py::arg("causal"), py::arg("threads"));
}
