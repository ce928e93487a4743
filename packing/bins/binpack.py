"""``pack``: assign sequences to fixed-capacity bins, the one entry point for offline packing.

Validation and over-long / empty sequence handling live here, once, for every strategy and both
backends (compiled ``nopad.packing._packer`` and the pure-Python reference ``nopad.packing.bins.algorithms``).
"""

from __future__ import annotations

import numbers
from typing import Literal

import numpy as np

from nopad.packing._native import native_packer
from nopad.packing.bins import algorithms
from nopad.packing.bins.stats import Bins

STRATEGIES = ("bfd", "ffd", "nextfit")
OVERFLOWS = ("error", "truncate", "split")
BACKENDS = ("auto", "native", "python")
MAX_CAPACITY = 1 << 24  # bfd/ffd keep O(capacity) tables (counting sort, a tree over rooms)


def pack(
    lengths,
    capacity: int,
    *,
    strategy: Literal["bfd", "ffd", "nextfit"] = "bfd",
    max_seqs_per_bin: int | None = None,
    seed: int | None = None,
    overflow: Literal["error", "truncate", "split"] = "error",
    skip_empty: bool = False,
    backend: Literal["auto", "native", "python"] = "auto",
) -> Bins:
    """Pack sequences of the given token ``lengths`` into bins of at most ``capacity`` tokens.

    strategy: ``"bfd"`` best-fit decreasing (densest, O(n log C)), ``"ffd"`` first-fit decreasing,
        ``"nextfit"`` keeps the input order (a new bin whenever the next sequence does not fit).
    max_seqs_per_bin: cap on sequences per bin (e.g. to bound per-sequence overhead).
    seed: randomises tie-breaking among equal lengths and equally good bins, so each epoch gets
        different bins with the same efficiency. None is deterministic. Not valid for "nextfit",
        whose bins are fixed by the input order.
    overflow: sequences longer than ``capacity``: ``"error"``, ``"truncate"`` (keep the first
        ``capacity`` tokens) or ``"split"`` (cut into ``capacity``-token pieces, packed separately).
    skip_empty: drop zero-length sequences (counted in the stats) instead of raising.
    backend: ``"native"`` (C++), ``"python"`` (reference) or ``"auto"`` (C++ when built).
    """
    capacity = _check_int("capacity", capacity, minimum=1)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(map(repr, STRATEGIES))}")
    if overflow not in OVERFLOWS:
        raise ValueError(f"unknown overflow {overflow!r}; choose one of {', '.join(map(repr, OVERFLOWS))}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    if strategy != "nextfit" and capacity > MAX_CAPACITY:
        raise ValueError(f"capacity {capacity} is above the {MAX_CAPACITY} tokens that {strategy!r} supports")
    max_seqs = 0 if max_seqs_per_bin is None else _check_int("max_seqs_per_bin", max_seqs_per_bin, minimum=1)
    if seed is not None:
        seed = _check_int("seed", seed) & 0xFFFFFFFFFFFFFFFF  # the generators take 64 bits
        if strategy == "nextfit":
            raise ValueError(
                "seed has no effect with strategy='nextfit' (its bins follow the input order); "
                "shuffle the input per epoch instead, or use 'bfd'/'ffd'"
            )
    lengths = as_lengths(lengths)

    items = _Items.build(lengths, capacity, overflow=overflow, skip_empty=skip_empty)
    module = _backend_module(backend)
    if strategy == "nextfit":
        offsets, order = module.nextfit(items.lengths, capacity, max_seqs)
    else:
        offsets, order = getattr(module, strategy)(items.lengths, capacity, max_seqs, seed)
    order = np.asarray(order, dtype=np.int64)
    return Bins(
        offsets,
        items.index[order] if items.index is not None else order,
        items.starts[order] if items.starts is not None else np.zeros(len(order), dtype=np.int64),
        items.lengths[order],
        capacity,
        num_sequences=len(lengths) - items.num_skipped_empty,
        tokens_truncated=items.tokens_truncated,
        num_truncated=items.num_truncated,
        num_split=items.num_split,
        num_skipped_empty=items.num_skipped_empty,
    )


def as_lengths(lengths) -> np.ndarray:
    """``lengths`` as a 1-D int64 array, or a clear error (floats, bools, 2-D, empty, negative)."""
    if hasattr(lengths, "detach"):  # a torch tensor
        lengths = lengths.detach().cpu().numpy()
    array = np.asarray(lengths)
    if array.ndim != 1:
        raise ValueError(f"lengths must be a 1-D array of sequence lengths; got shape {array.shape}")
    if array.size == 0:
        raise ValueError("lengths is empty: there is nothing to pack")
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(
            f"lengths must be integers (token counts); got dtype {array.dtype}"
            + (f", e.g. lengths[0] = {array[0]!r}" if array.dtype != object else "")
        )
    array = array.astype(np.int64, copy=False)
    if array.min() < 0:
        i = int(np.argmax(array < 0))
        raise ValueError(f"lengths[{i}] = {array[i]} is negative; sequence lengths must be >= 1")
    return array


class _Items:
    """What actually goes into bins after dropping empty and cutting over-long sequences."""

    def __init__(self, lengths, index=None, starts=None, **counters):
        self.lengths = lengths
        self.index = index  # input sequence of each item; None means item k is sequence k
        self.starts = starts  # token offset of each item in its sequence; None means all 0
        self.tokens_truncated = counters.get("tokens_truncated", 0)
        self.num_truncated = counters.get("num_truncated", 0)
        self.num_split = counters.get("num_split", 0)
        self.num_skipped_empty = counters.get("num_skipped_empty", 0)

    @classmethod
    def build(cls, lengths: np.ndarray, capacity: int, *, overflow: str, skip_empty: bool) -> _Items:
        index = None
        num_skipped = 0
        if lengths.min() == 0:
            if not skip_empty:
                i = int(np.argmax(lengths == 0))
                raise ValueError(f"lengths[{i}] is 0 (an empty sequence); drop empty sequences or pass skip_empty=True")
            index = np.flatnonzero(lengths)
            num_skipped = len(lengths) - len(index)
            lengths = lengths[index]
        if len(lengths) == 0 or lengths.max() <= capacity:
            return cls(lengths, index, num_skipped_empty=num_skipped)

        too_long = lengths > capacity
        if overflow == "error":
            i = int(np.argmax(too_long))
            original = i if index is None else int(index[i])
            raise ValueError(
                f"sequence {original} has length {lengths[i]} > capacity {capacity} "
                f"({int(too_long.sum())} sequences are too long); pass overflow='truncate' or 'split', "
                "or raise the capacity"
            )
        if index is None:
            index = np.arange(len(lengths), dtype=np.int64)
        if overflow == "truncate":
            return cls(
                np.minimum(lengths, capacity),
                index,
                tokens_truncated=int((lengths[too_long] - capacity).sum()),
                num_truncated=int(too_long.sum()),
                num_skipped_empty=num_skipped,
            )
        pieces = -(-lengths // capacity)  # ceil
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = (np.arange(int(pieces.sum()), dtype=np.int64) - first) * capacity
        piece_index = np.repeat(np.arange(len(lengths)), pieces)
        return cls(
            np.minimum(lengths[piece_index] - starts, capacity),
            index[piece_index],
            starts,
            num_split=int(too_long.sum()),
            num_skipped_empty=num_skipped,
        )


def _backend_module(backend: str):
    if backend == "python":
        return algorithms
    module = native_packer()
    if module is None:
        if backend == "native":
            raise RuntimeError("backend='native' but the compiled packer is not built; run `pip install -e .`")
        return algorithms
    return module


def _check_int(name: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer; got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return value
