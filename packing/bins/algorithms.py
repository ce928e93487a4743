"""Pure-Python reference implementations of the compiled packers in csrc/packer.cpp.

They are the fallback when the extension is not built and the ground truth the tests compare the
C++ code against, so each function mirrors its C++ twin step by step (same sort, same tie-breaking,
same random numbers). Inputs are already validated: item lengths in [1, capacity].

Each returns ``(offsets, items)`` as int64 arrays: bin ``b`` holds the input positions
``items[offsets[b]:offsets[b + 1]]`` in the order they were placed; bins are in opening order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK64 = (1 << 64) - 1


class SplitMix64:
    """The splitmix64 generator, bit-identical to the C++ one."""

    def __init__(self, seed: int):
        self.state = seed & _MASK64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, k: int) -> int:
        """Uniform integer in [0, k) by multiply-high."""
        return (self.next() * k) >> 64


def decreasing_order(lengths: Sequence[int], rng: SplitMix64 | None) -> list[int]:
    """Positions ordered longest first; ties in input order, or shuffled when ``rng`` is given."""
    perm = list(range(len(lengths)))
    if rng is not None:
        for i in range(len(perm) - 1, 0, -1):
            j = rng.below(i + 1)
            perm[i], perm[j] = perm[j], perm[i]
    return sorted(perm, key=lambda i: -lengths[i])  # stable, like the C++ counting sort


def _to_csr(order: list[int], bin_of: list[int], num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    buckets: list[list[int]] = [[] for _ in range(num_bins)]
    for position, b in zip(order, bin_of):
        buckets[b].append(position)
    offsets = np.zeros(num_bins + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(bucket) for bucket in buckets], dtype=np.int64)
    items = np.fromiter((p for bucket in buckets for p in bucket), dtype=np.int64, count=len(order))
    return offsets, items


class _MaxTree:
    """Max segment tree; ``leftmost_at_least(v)`` is the first leaf holding ``v`` or more."""

    def __init__(self, leaves: int):
        self.size = 1
        while self.size < leaves:
            self.size <<= 1
        self.tree = [0] * (2 * self.size)

    def set(self, leaf: int, value: int) -> None:
        i = leaf + self.size
        self.tree[i] = value
        i >>= 1
        while i >= 1:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i >>= 1

    def leftmost_at_least(self, v: int) -> int:
        if self.tree[1] < v:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= v else 2 * i + 1
        return i - self.size


def bfd(lengths: Sequence[int], capacity: int, max_seqs: int = 0, seed: int | None = None):
    """Best-fit decreasing: each item, longest first, into the open bin with the least room that
    fits it; bins with equal room form a stack, and a seed picks a random one of them."""
    lengths = [int(x) for x in lengths]
    rng = SplitMix64(seed) if seed is not None else None
    order = decreasing_order(lengths, rng)
    tree = _MaxTree(capacity)  # leaf r-1 <-> remaining room r
    bins_with_room: dict[int, list[int]] = {}
    room: list[int] = []
    count: list[int] = []
    bin_of = [0] * len(order)
    for k, position in enumerate(order):
        length = lengths[position]
        leaf = tree.leftmost_at_least(length)
        if leaf < 0:
            b = len(room)
            room.append(capacity)
            count.append(0)
        else:
            stack = bins_with_room[leaf + 1]
            j = len(stack) - 1
            if rng is not None and j > 0:
                r = rng.below(j + 1)
                stack[r], stack[j] = stack[j], stack[r]
            b = stack.pop()
            if not stack:
                tree.set(leaf, 0)
        bin_of[k] = b
        room[b] -= length
        count[b] += 1
        if room[b] > 0 and (max_seqs <= 0 or count[b] < max_seqs):
            stack = bins_with_room.setdefault(room[b], [])
            if not stack:
                tree.set(room[b] - 1, room[b])
            stack.append(b)
    return _to_csr(order, bin_of, len(room))


def ffd(lengths: Sequence[int], capacity: int, max_seqs: int = 0, seed: int | None = None):
    """First-fit decreasing: each item, longest first, into the earliest-opened bin that fits it."""
    lengths = [int(x) for x in lengths]
    rng = SplitMix64(seed) if seed is not None else None
    order = decreasing_order(lengths, rng)
    tree = _MaxTree(max(len(lengths), 1))
    room: list[int] = []
    count: list[int] = []
    bin_of = [0] * len(order)
    for k, position in enumerate(order):
        length = lengths[position]
        b = tree.leftmost_at_least(length)
        if b < 0:
            b = len(room)
            room.append(capacity)
            count.append(0)
        bin_of[k] = b
        room[b] -= length
        count[b] += 1
        tree.set(b, room[b] if max_seqs <= 0 or count[b] < max_seqs else 0)
    return _to_csr(order, bin_of, len(room))


def nextfit(lengths: Sequence[int], capacity: int, max_seqs: int = 0):
    """Next-fit: keep input order, open a new bin whenever the item does not fit the current one."""
    bin_of = []
    num_bins = room = count = 0
    for length in lengths:
        length = int(length)
        if num_bins == 0 or length > room or (max_seqs > 0 and count >= max_seqs):
            num_bins += 1
            room, count = capacity, 0
        bin_of.append(num_bins - 1)
        room -= length
        count += 1
    return _to_csr(list(range(len(bin_of))), bin_of, num_bins)


def gather_bytes(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``src[starts[k] : starts[k] + lengths[k]]`` for every k (uint8 arrays).
    One slice per range: memory stays at the size of the output."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(starts) != len(lengths):
        raise ValueError("starts and lengths differ in size")
    if len(starts) and (starts.min() < 0 or lengths.min() < 0 or (starts + lengths).max() > len(src)):
        raise IndexError("byte range outside the source")
    if len(starts) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.concatenate([src[s : s + n] for s, n in zip(starts.tolist(), lengths.tolist())])
