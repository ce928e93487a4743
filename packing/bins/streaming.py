"""``StreamingPacker``: packing for data that arrives one sequence at a time (streaming datasets,
iterable loaders), with a bounded look-ahead buffer instead of the whole dataset in memory.

Sequences wait in a buffer of ``buffer_size``. When it is full, one bin is built and emitted: it
starts with the longest buffered sequence, then repeatedly takes the longest buffered sequence
that still fits the remaining room (best fit for the room), until nothing fits. With a buffer of a
few thousand sequences there is almost always a short sequence to fill the last gap, so bins come
out nearly as full as global best-fit decreasing (see
tests/packing/test_packing_streaming.py), and every bin is
final the moment it is emitted. ``state_dict()`` captures the buffer and the random state, so a
loader that saves it resumes with exactly the same bins.
"""

from __future__ import annotations

import bisect
import random
from typing import Any, NamedTuple

from nopad.packing.bins.binpack import OVERFLOWS, _check_int


class StreamItem(NamedTuple):
    """One packed item: tokens ``start : start + length`` of the sequence called ``key``."""

    key: Any
    length: int
    start: int = 0


_COUNTERS = (
    "num_added",
    "num_bins",
    "num_items_emitted",
    "num_tokens_emitted",
    "num_truncated",
    "tokens_truncated",
    "num_split",
)


class StreamingPacker:
    """Streaming best-fit packer over a bounded buffer.

    ``add(length, key)`` returns the bins that closed (usually none or one), each a list of
    :class:`StreamItem`; ``flush()`` packs whatever is left at the end of the stream.
    ``seed`` randomises which of several equally long buffered sequences is taken (None: oldest
    first). ``overflow`` treats sequences longer than ``capacity`` like :func:`nopad.packing.pack`.
    """

    def __init__(
        self,
        capacity: int,
        buffer_size: int,
        *,
        max_seqs_per_bin: int | None = None,
        seed: int | None = None,
        overflow: str = "error",
    ):
        self.capacity = _check_int("capacity", capacity, minimum=1)
        self.buffer_size = _check_int("buffer_size", buffer_size, minimum=1)
        self.max_seqs_per_bin = (
            None if max_seqs_per_bin is None else _check_int("max_seqs_per_bin", max_seqs_per_bin, minimum=1)
        )
        if overflow not in OVERFLOWS:
            choices = ", ".join(map(repr, OVERFLOWS))
            raise ValueError(f"unknown overflow {overflow!r}; choose one of {choices}")
        self.overflow = overflow
        self.seed = None if seed is None else _check_int("seed", seed)
        self._rng = random.Random(self.seed) if self.seed is not None else None
        self._by_length: dict[int, list[StreamItem]] = {}  # buffered items per length, oldest first
        self._lengths: list[int] = []  # sorted distinct buffered lengths
        self._size = 0
        for name in _COUNTERS:
            setattr(self, name, 0)

    def __len__(self) -> int:
        """Number of items waiting in the buffer."""
        return self._size

    @property
    def efficiency(self) -> float:
        """Real tokens / (bins x capacity) over the bins emitted so far."""
        return self.num_tokens_emitted / (self.num_bins * self.capacity) if self.num_bins else 0.0

    def add(self, length: int, key: Any = None) -> list[list[StreamItem]]:
        """Buffer one sequence (``key`` defaults to its arrival number); return the bins that closed."""
        length = _check_int("length", length)
        if length <= 0:
            raise ValueError(f"sequence {key!r} has length {length}; lengths must be >= 1 (drop empty ones)")
        if key is None:
            key = self.num_added
        self.num_added += 1
        if length > self.capacity:
            if self.overflow == "error":
                raise ValueError(
                    f"sequence {key!r} has length {length} > capacity {self.capacity}; "
                    "pass overflow='truncate' or 'split', or raise the capacity"
                )
            if self.overflow == "truncate":
                self.num_truncated += 1
                self.tokens_truncated += length - self.capacity
                self._push(StreamItem(key, self.capacity))
            else:
                self.num_split += 1
                for start in range(0, length, self.capacity):
                    self._push(StreamItem(key, min(self.capacity, length - start), start))
        else:
            self._push(StreamItem(key, length))
        closed = []
        while self._size >= self.buffer_size:
            closed.append(self._close_bin())
        return closed

    def flush(self) -> list[list[StreamItem]]:
        """Pack and return everything still buffered (call at the end of the stream)."""
        closed = []
        while self._size:
            closed.append(self._close_bin())
        return closed

    def _push(self, item: StreamItem) -> None:
        same = self._by_length.get(item.length)
        if same is None:
            same = self._by_length[item.length] = []
            bisect.insort(self._lengths, item.length)
        same.append(item)
        self._size += 1

    def _take(self, length: int) -> StreamItem:
        same = self._by_length[length]
        if self._rng is not None and len(same) > 1:
            i = self._rng.randrange(len(same))
            same[i], same[-1] = same[-1], same[i]
            item = same.pop()
        else:
            item = same.pop(0)
        if not same:
            del self._by_length[length]
            del self._lengths[bisect.bisect_left(self._lengths, length)]
        self._size -= 1
        return item

    def _close_bin(self) -> list[StreamItem]:
        items = [self._take(self._lengths[-1])]
        room = self.capacity - items[0].length
        limit = self.max_seqs_per_bin or self._size + 1
        while room > 0 and len(items) < limit and self._lengths:
            i = bisect.bisect_right(self._lengths, room) - 1
            if i < 0:
                break
            item = self._take(self._lengths[i])
            items.append(item)
            room -= item.length
        self.num_bins += 1
        self.num_items_emitted += len(items)
        self.num_tokens_emitted += self.capacity - room
        return items

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with exactly the same bins (keys must be picklable)."""
        buffer = [tuple(item) for length in self._lengths for item in self._by_length[length]]
        return {
            "capacity": self.capacity,
            "buffer": buffer,
            "rng_state": self._rng.getstate() if self._rng is not None else None,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["capacity"] != self.capacity:
            raise ValueError(f"state was saved with capacity {state['capacity']}, this packer has {self.capacity}")
        if (state["rng_state"] is None) != (self._rng is None):
            raise ValueError("state and packer disagree on whether a seed is used; create the packer alike")
        self._by_length.clear()
        self._lengths.clear()
        self._size = 0
        for entry in state["buffer"]:
            self._push(StreamItem(*entry))
        if self._rng is not None:
            version, internal, gauss = state["rng_state"]  # tuples may come back as lists (JSON)
            self._rng.setstate((version, tuple(internal), gauss))
        for name in _COUNTERS:
            setattr(self, name, state["counters"][name])

    def __repr__(self) -> str:
        return (
            f"StreamingPacker(capacity={self.capacity}, buffer_size={self.buffer_size}, "
            f"buffered={self._size}, bins={self.num_bins}, efficiency={self.efficiency:.2%})"
        )
