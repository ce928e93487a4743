"""The result of packing: bins as flat arrays (CSR), plus the numbers that say how good they are.

Arrays rather than lists of lists so a million sequences cost a few int64 arrays, and so the
dataset code can turn bins into an Arrow take + list offsets without a Python loop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class PackStats:
    """How well a packing uses its bins. ``efficiency`` = real tokens / (bins x capacity)."""

    num_bins: int
    num_sequences: int  # input sequences that were packed (a split sequence counts once)
    num_items: int  # pieces placed in bins (> num_sequences when sequences were split)
    capacity: int
    total_tokens: int
    efficiency: float
    lower_bound: int  # ceil(total_tokens / capacity): no packing can use fewer bins
    tokens_truncated: int
    num_truncated: int
    num_split: int
    num_skipped_empty: int
    attention_cost_max: int  # max over bins of sum(l^2): the busiest bin's attention work
    attention_cost_mean: float

    def __str__(self) -> str:
        lines = [
            f"{self.num_sequences} sequences ({self.total_tokens} tokens) in {self.num_bins} bins of "
            f"{self.capacity} (lower bound {self.lower_bound}): efficiency {self.efficiency:.2%}",
            f"attention cost sum(l^2) per bin: max {self.attention_cost_max}, mean {self.attention_cost_mean:.0f}",
        ]
        if self.num_truncated:
            lines.append(f"truncated {self.num_truncated} sequences ({self.tokens_truncated} tokens dropped)")
        if self.num_split:
            lines.append(f"split {self.num_split} over-long sequences into {self.capacity}-token pieces")
        if self.num_skipped_empty:
            lines.append(f"skipped {self.num_skipped_empty} empty sequences")
        return "\n".join(lines)


class Bins:
    """Packed bins in CSR form.

    Bin ``b`` holds items ``offsets[b]:offsets[b + 1]``; item ``k`` is tokens
    ``starts[k] : starts[k] + lengths[k]`` of input sequence ``indices[k]`` (``starts`` is 0 unless
    the sequence was split or truncated). Iterating yields each bin's sequence indices.
    """

    def __init__(
        self,
        offsets: np.ndarray,
        indices: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        capacity: int,
        *,
        num_sequences: int | None = None,
        tokens_truncated: int = 0,
        num_truncated: int = 0,
        num_split: int = 0,
        num_skipped_empty: int = 0,
    ):
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.indices = np.asarray(indices, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if not (len(self.indices) == len(self.starts) == len(self.lengths) == self.offsets[-1]):
            raise ValueError("Bins: indices, starts and lengths must all have offsets[-1] entries")
        self.capacity = int(capacity)
        self._num_sequences = num_sequences
        self._counters = dict(
            tokens_truncated=int(tokens_truncated),
            num_truncated=int(num_truncated),
            num_split=int(num_split),
            num_skipped_empty=int(num_skipped_empty),
        )

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __iter__(self) -> Iterator[np.ndarray]:
        for b in range(len(self)):
            yield self.indices[self.offsets[b] : self.offsets[b + 1]]

    def __getitem__(self, b: int) -> np.ndarray:
        """Sequence indices in bin ``b``."""
        lo, hi = self._bounds(b)
        return self.indices[lo:hi]

    def items(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(indices, starts, lengths)`` of the items in bin ``b``."""
        lo, hi = self._bounds(b)
        return self.indices[lo:hi], self.starts[lo:hi], self.lengths[lo:hi]

    def _bounds(self, b: int) -> tuple[int, int]:
        n = len(self)
        if not -n <= b < n:
            raise IndexError(f"bin {b} out of range for {n} bins")
        b %= n
        return int(self.offsets[b]), int(self.offsets[b + 1])

    @cached_property
    def bin_tokens(self) -> np.ndarray:
        """Real tokens in each bin."""
        return _segment_sum(self.lengths, self.offsets)

    @cached_property
    def bin_num_items(self) -> np.ndarray:
        return np.diff(self.offsets)

    @cached_property
    def attention_cost(self) -> np.ndarray:
        """sum(l^2) per bin: proportional to causal attention work on the bin."""
        return _segment_sum(self.lengths * self.lengths, self.offsets)

    @cached_property
    def stats(self) -> PackStats:
        total = int(self.lengths.sum())
        num_bins = len(self)
        cost = self.attention_cost
        num_sequences = self._num_sequences
        if num_sequences is None:
            num_sequences = len(np.unique(self.indices))
        return PackStats(
            num_bins=num_bins,
            num_sequences=int(num_sequences),
            num_items=len(self.indices),
            capacity=self.capacity,
            total_tokens=total,
            efficiency=total / (num_bins * self.capacity) if num_bins else 0.0,
            lower_bound=math.ceil(total / self.capacity),
            attention_cost_max=int(cost.max()) if num_bins else 0,
            attention_cost_mean=float(cost.mean()) if num_bins else 0.0,
            **self._counters,
        )

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"Bins(num_bins={s.num_bins}, num_sequences={s.num_sequences}, capacity={s.capacity}, "
            f"total_tokens={s.total_tokens}, efficiency={s.efficiency:.2%}, lower_bound={s.lower_bound})"
        )


def _segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sum of ``values[offsets[b]:offsets[b+1]]`` for every b (no empty segments expected)."""
    if len(offsets) <= 1:
        return np.zeros(0, dtype=np.int64)
    csum = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    return csum[offsets[1:]] - csum[offsets[:-1]]
