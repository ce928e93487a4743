// Compiled bin-packing hot paths for nopad (`packing._packer`).
//
// Every routine here has a line-by-line pure-Python twin in packing/algorithms.py; the tests check
// that both give identical bins on random inputs, with and without a seed. Keep them in step.
//
// All routines take validated int64 item lengths in [1, capacity] (packing/pack.py validates) and
// return (offsets[num_bins + 1], items[n]) as int64 numpy arrays: bin b holds the input positions
// items[offsets[b]:offsets[b + 1]], in the order they were placed.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <utility>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;
using u64 = uint64_t;

namespace {

// splitmix64: tiny, fast, and easy to reproduce bit-for-bit in Python.
struct SplitMix64 {
    u64 state;
    explicit SplitMix64(u64 seed) : state(seed) {}
    u64 next() {
        state += 0x9E3779B97F4A7C15ULL;
        u64 z = state;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        return z ^ (z >> 31);
    }
    // Uniform integer in [0, k) by multiply-high (Lemire, without the rejection step).
    i64 below(i64 k) {
        return static_cast<i64>((static_cast<unsigned __int128>(next()) * static_cast<u64>(k)) >> 64);
    }
};

// Positions 0..n-1 ordered by length, longest first. Ties keep input order, or a random order when
// seeded (Fisher-Yates shuffle first, then a stable counting sort: O(n + capacity)).
std::vector<i64> decreasing_order(const i64* len, i64 n, i64 capacity, SplitMix64* rng,
                                  std::vector<i64>* sorted_len) {
    std::vector<i64> perm;
    if (rng) {
        perm.resize(n);
        for (i64 i = 0; i < n; ++i) perm[i] = i;
        for (i64 i = n - 1; i > 0; --i) std::swap(perm[i], perm[rng->below(i + 1)]);
    }
    std::vector<i64> start(capacity + 2, 0);  // start[c]: first slot for length c, longest first
    for (i64 i = 0; i < n; ++i) ++start[capacity - len[i] + 1];
    for (i64 c = 1; c <= capacity + 1; ++c) start[c] += start[c - 1];
    std::vector<i64> order(n);
    sorted_len->resize(n);
    for (i64 i = 0; i < n; ++i) {
        const i64 p = rng ? perm[i] : i;
        const i64 slot = start[capacity - len[p]]++;
        order[slot] = p;
        (*sorted_len)[slot] = len[p];
    }
    return order;
}

// Group the placed items by bin (bins in opening order, items in placement order).
py::tuple to_csr(const std::vector<i64>& order, const std::vector<i64>& bin_of, i64 num_bins) {
    const i64 n = static_cast<i64>(order.size());
    py::array_t<i64> offsets_arr(num_bins + 1);
    py::array_t<i64> items_arr(n);
    i64* offsets = offsets_arr.mutable_data();
    i64* items = items_arr.mutable_data();
    std::fill(offsets, offsets + num_bins + 1, 0);
    for (i64 k = 0; k < n; ++k) ++offsets[bin_of[k] + 1];
    for (i64 b = 0; b < num_bins; ++b) offsets[b + 1] += offsets[b];
    std::vector<i64> cursor(offsets, offsets + num_bins);
    for (i64 k = 0; k < n; ++k) items[cursor[bin_of[k]]++] = order[k];
    return py::make_tuple(offsets_arr, items_arr);
}

// Max segment tree over leaves 0..size-1 (int32: callers keep values <= 2^24).
struct MaxTree {
    i64 size = 1;
    std::vector<int32_t> tree;
    explicit MaxTree(i64 leaves) {
        while (size < leaves) size <<= 1;
        tree.assign(2 * size, 0);
    }
    void set(i64 leaf, i64 value) {
        i64 i = leaf + size;
        tree[i] = static_cast<int32_t>(value);
        for (i >>= 1; i >= 1; i >>= 1) {
            const int32_t m = std::max(tree[2 * i], tree[2 * i + 1]);
            if (tree[i] == m) break;  // ancestors are unchanged too
            tree[i] = m;
        }
    }
    // First leaf holding v or more, searching from the root; -1 if none.
    i64 leftmost_at_least(i64 v) const {
        if (tree[1] < v) return -1;
        i64 i = 1;
        while (i < size) i = tree[2 * i] >= v ? 2 * i : 2 * i + 1;
        return i - size;
    }
    // Same answer when every leaf before `start` is known to hold less than v, found bottom-up
    // from `start` (cheap when the answer is near it, as in best fit where leaf r holds r).
    i64 leftmost_at_least_from(i64 start, i64 v) const {
        if (tree[1] < v) return -1;  // common for long items: nothing open fits
        i64 i = start + size;
        if (tree[i] >= v) return start;
        for (;;) {
            if (i == 1) return -1;
            if (!(i & 1) && tree[i + 1] >= v) {
                ++i;
                break;
            }
            i >>= 1;
        }
        while (i < size) i = tree[2 * i] >= v ? 2 * i : 2 * i + 1;
        return i - size;
    }
};

struct Input {
    const i64* len;
    i64 n;
};

Input as_input(const py::array_t<i64, py::array::c_style | py::array::forcecast>& lengths) {
    if (lengths.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
    return {lengths.data(), static_cast<i64>(lengths.shape(0))};
}

// Best-fit decreasing: each item (longest first) goes to the open bin with the least remaining room
// that still fits it. Leaf r of the tree holds r while some open bin has exactly r tokens left, so
// the smallest fitting room is one O(log C) descent. Bins with equal room sit in a stack; a seed
// picks a random one of them.
py::tuple bfd(const py::array_t<i64, py::array::c_style | py::array::forcecast>& lengths, i64 capacity,
              i64 max_seqs, py::object seed) {
    Input in = as_input(lengths);
    if (in.n >= (i64{1} << 31)) throw std::invalid_argument("bfd packs at most 2^31 - 1 sequences per call");
    const bool seeded = !seed.is_none();
    SplitMix64 rng(seeded ? seed.cast<u64>() : 0);
    std::vector<i64> order, sorted_len, bin_of(in.n);
    i64 num_bins = 0;
    {
        py::gil_scoped_release release;
        order = decreasing_order(in.len, in.n, capacity, seeded ? &rng : nullptr, &sorted_len);
        MaxTree tree(capacity);  // leaf r-1 <-> remaining room r in [1, capacity]
        struct Bin {  // 12 bytes: rooms are <= 2^24 (checked in Python), counts and ids < 2^31
            int32_t room, count, below;  // `below`: next bin down the stack of bins with this room
        };
        std::vector<Bin> bins;
        // Stacks of bins by room: intrusive lists when unseeded (no allocation), vectors when a
        // seed needs to pick a random member.
        std::vector<i64> top(capacity + 1, -1);
        std::vector<std::vector<i64>> stacks(seeded ? capacity + 1 : 0);
        for (i64 k = 0; k < in.n; ++k) {
            const i64 l = sorted_len[k];
            i64 b;
            const i64 leaf = tree.leftmost_at_least_from(l - 1, l);
            if (leaf < 0) {
                b = num_bins++;
                bins.push_back({static_cast<int32_t>(capacity), 0, -1});
            } else if (!seeded) {
                b = top[leaf + 1];
                top[leaf + 1] = bins[b].below;
                if (top[leaf + 1] < 0) tree.set(leaf, 0);
            } else {
                std::vector<i64>& stack = stacks[leaf + 1];
                const i64 j = static_cast<i64>(stack.size()) - 1;
                if (j > 0) std::swap(stack[rng.below(j + 1)], stack[j]);
                b = stack[j];
                stack.pop_back();
                if (stack.empty()) tree.set(leaf, 0);
            }
            bin_of[k] = b;
            Bin& bin = bins[b];
            bin.room -= static_cast<int32_t>(l);
            bin.count += 1;
            if (bin.room > 0 && (max_seqs <= 0 || bin.count < max_seqs)) {
                const i64 r = bin.room;
                if (!seeded) {
                    if (top[r] < 0) tree.set(r - 1, r);
                    bin.below = static_cast<int32_t>(top[r]);
                    top[r] = b;
                } else {
                    if (stacks[r].empty()) tree.set(r - 1, r);
                    stacks[r].push_back(b);
                }
            }
        }
    }
    return to_csr(order, bin_of, num_bins);
}

// First-fit decreasing: each item (longest first) goes to the earliest-opened bin that fits it,
// found with a max tree over the bins' remaining room.
py::tuple ffd(const py::array_t<i64, py::array::c_style | py::array::forcecast>& lengths, i64 capacity,
              i64 max_seqs, py::object seed) {
    Input in = as_input(lengths);
    const bool seeded = !seed.is_none();
    SplitMix64 rng(seeded ? seed.cast<u64>() : 0);
    std::vector<i64> order, sorted_len, bin_of(in.n);
    i64 num_bins = 0;
    {
        py::gil_scoped_release release;
        order = decreasing_order(in.len, in.n, capacity, seeded ? &rng : nullptr, &sorted_len);
        MaxTree tree(std::max<i64>(in.n, 1));
        std::vector<i64> room, count;
        for (i64 k = 0; k < in.n; ++k) {
            const i64 l = sorted_len[k];
            i64 b = tree.leftmost_at_least(l);
            if (b < 0) {
                b = num_bins++;
                room.push_back(capacity);
                count.push_back(0);
            }
            bin_of[k] = b;
            room[b] -= l;
            count[b] += 1;
            const bool open = max_seqs <= 0 || count[b] < max_seqs;
            tree.set(b, open ? room[b] : 0);
        }
    }
    return to_csr(order, bin_of, num_bins);
}

// Next-fit: keep input order; start a new bin whenever the item does not fit the current one.
py::tuple nextfit(const py::array_t<i64, py::array::c_style | py::array::forcecast>& lengths, i64 capacity,
                  i64 max_seqs) {
    Input in = as_input(lengths);
    std::vector<i64> order(in.n), bin_of(in.n);
    i64 num_bins = 0;
    {
        py::gil_scoped_release release;
        i64 room = 0, count = 0;
        for (i64 k = 0; k < in.n; ++k) {
            const i64 l = in.len[k];
            if (num_bins == 0 || l > room || (max_seqs > 0 && count >= max_seqs)) {
                ++num_bins;
                room = capacity;
                count = 0;
            }
            order[k] = k;
            bin_of[k] = num_bins - 1;
            room -= l;
            count += 1;
        }
    }
    return to_csr(order, bin_of, num_bins);
}

// Concatenate byte ranges src[starts[k] : starts[k] + lengths[k]] in order: the token copy behind
// pack_dataset (one memcpy per packed sequence, instead of Arrow's element-wise list take).
py::array_t<uint8_t> gather_bytes(const py::array_t<uint8_t, py::array::c_style>& src,
                                  const py::array_t<i64, py::array::c_style | py::array::forcecast>& starts,
                                  const py::array_t<i64, py::array::c_style | py::array::forcecast>& lengths) {
    const i64 n = static_cast<i64>(starts.size());
    if (static_cast<i64>(lengths.size()) != n) throw std::invalid_argument("starts and lengths differ in size");
    const i64* s = starts.data();
    const i64* l = lengths.data();
    const i64 size = static_cast<i64>(src.size());
    i64 total = 0;
    for (i64 k = 0; k < n; ++k) {
        if (s[k] < 0 || l[k] < 0 || s[k] + l[k] > size) throw std::out_of_range("byte range outside the source");
        total += l[k];
    }
    py::array_t<uint8_t> out(total);
    const uint8_t* from = src.data();
    uint8_t* to = out.mutable_data();
    {
        py::gil_scoped_release release;
        for (i64 k = 0; k < n; ++k) {
            std::memcpy(to, from + s[k], static_cast<size_t>(l[k]));
            to += l[k];
        }
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_packer, m) {
    m.doc() = "Compiled bin packing for nopad; see packing/algorithms.py for the reference.";
    m.def("bfd", &bfd, py::arg("lengths"), py::arg("capacity"), py::arg("max_seqs") = 0,
          py::arg("seed") = py::none());
    m.def("ffd", &ffd, py::arg("lengths"), py::arg("capacity"), py::arg("max_seqs") = 0,
          py::arg("seed") = py::none());
    m.def("nextfit", &nextfit, py::arg("lengths"), py::arg("capacity"), py::arg("max_seqs") = 0);
    m.def("gather_bytes", &gather_bytes, py::arg("src"), py::arg("starts"), py::arg("lengths"));
}
