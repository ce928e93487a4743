"""The prefix cache of hybrid models: state snapshots at block boundaries.

A cached K/V block lets a later request skip the attention layers' work on its tokens, but a
stateful layer (Gated DeltaNet, short convolution, Mamba2) needs its state *after* those tokens,
and a block says nothing about it. So, as vLLM's hybrid prefix caching and SGLang's Mamba radix
cache do, the state is kept where it is known:

- **Taken.** When a prefill chunk ends on a full block boundary, every stateful layer's conv and
  recurrent state of that sequence is copied into a snapshot slot, keyed by the hash of the block
  that ends there (the KV prefix cache's chained hash, so it names the whole prefix). With
  snapshots on, a prefill chunk that crosses a block boundary is cut back to the last one it
  crosses (:func:`aligned_chunk`), so the last full block of every prompt gets one; the tail runs
  in the next step. A request whose prompt matches cached blocks beyond the last snapshot (a
  system prompt that ends inside a block another request went past) also ends a chunk where the
  match ends, so the requests after it find a snapshot there.
- **Used.** A later request reuses cached blocks only up to the last one that has a snapshot
  (:func:`usable_hits`); its own slot starts from a copy of that snapshot and it prefills the rest.
  No snapshot, no reuse: it computes its state from its first token. Never a wrong state.
- **Held.** Snapshot slots are rows of the same state tensors as the sequences' slots
  (:class:`nopad.inference.state_cache.StateCache`), paid for out of the same memory budget. A snapshot
  lives as long as its block's hash does (the allocator forgets the hash when it evicts the block
  or drops the cache, and tells :meth:`StateSnapshots.forget`); with every snapshot slot taken, the
  least recently used snapshot goes first.

Copies are queued on the :class:`~nopad.inference.state_cache.StateSlots` and applied in order before
the next forward, so a restore queued before a snapshot slot is reused reads the old snapshot.
Only prefill chunks are snapshotted (decode steps would copy every state once per block).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from nopad.inference.state_cache import StateSlots
from nopad.packing.blocks import BlockAllocator

if TYPE_CHECKING:
    from nopad.inference.request import Sequence


class StateSnapshots:
    """``capacity`` snapshot slots (rows ``first .. first + capacity - 1`` of the state tensors,
    after the sequences' slots), keyed by block hash, least recently used first."""

    def __init__(self, slots: StateSlots, capacity: int, block_size: int):
        if capacity < 1:
            raise ValueError(f"num_state_snapshots must be >= 1 to cache prefixes, got {capacity}")
        self.slots, self.capacity, self.block_size = slots, capacity, block_size
        self.first = slots.num_slots
        self._free: deque[int] = deque(range(self.first, self.first + capacity))
        self._by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, LRU first
        self.taken = self.restored = self.evicted = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def take(self, seq_slot: int, block_hash: int) -> None:
        """Keep the state of ``seq_slot`` as it is after this step under ``block_hash``."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)  # the same prefix: the same state
            return
        if not self._free:
            _, slot = self._by_hash.popitem(last=False)
            self.evicted += 1
        else:
            slot = self._free.popleft()
        self._by_hash[block_hash] = slot
        self.slots.copy(seq_slot, slot)
        self.taken += 1

    def restore(self, block_hash: int, seq_slot: int) -> None:
        """``seq_slot`` starts from the snapshot under ``block_hash``."""
        slot = self._by_hash[block_hash]
        self._by_hash.move_to_end(block_hash)
        self.slots.copy(slot, seq_slot)
        self.restored += 1

    def forget(self, block_hash: int) -> None:
        """The block under ``block_hash`` left the prefix cache: its snapshot goes with it."""
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def stats(self) -> dict[str, int]:
        return {
            "state_snapshots": len(self),
            "state_snapshots_taken": self.taken,
            "state_snapshot_hits": self.restored,
            "state_snapshot_evictions": self.evicted,
        }


def state_snapshots(layer_states: list, enable_prefix_caching: bool, wanted: int | None, max_num_seqs: int) -> int:
    """How many snapshot slots a generator keeps: ``wanted``, by default one per sequence slot;
    none on an attention-only model (its blocks are its whole context) or with the cache off."""
    if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 0):
        raise ValueError(f"num_state_snapshots must be an int >= 0 (or None), got {wanted!r}")
    if not layer_states or not enable_prefix_caching:
        return 0
    return max_num_seqs if wanted is None else wanted


def make_state_slots(
    layer_states: list, max_num_seqs: int, num_snapshots: int, allocator: BlockAllocator
) -> StateSlots | None:
    """A generator's state slots: one per sequence (none on an attention-only model), then
    ``num_snapshots`` snapshot slots, each dropped when the allocator forgets its block's hash."""
    if not layer_states:
        return None
    slots = StateSlots(max_num_seqs)
    if num_snapshots:
        slots.snapshots = StateSnapshots(slots, num_snapshots, allocator.block_size)
        allocator.on_forget = slots.snapshots.forget
    return slots


def snapshot_stats(slots: StateSlots | None) -> dict[str, int]:
    """The snapshot counters for ``Generator.stats()`` (none without snapshots)."""
    return slots.snapshots.stats() if slots is not None and slots.snapshots is not None else {}


def reset_snapshot_stats(slots: StateSlots | None) -> None:
    if slots is not None and slots.snapshots is not None:
        slots.snapshots.taken = slots.snapshots.restored = slots.snapshots.evicted = 0


def usable_hits(slots: StateSlots | None, hits: list[tuple[int, int]], seq: Sequence) -> list[tuple[int, int]]:
    """The cached ``(block, hash)`` prefix a new sequence may reuse: all of it on an attention-only
    model, up to the last block with a state snapshot on a hybrid one (none without snapshots).
    Where more blocks matched than that, ``seq.snapshot_at`` asks its prefill to stop there."""
    if slots is None:
        return hits
    snapshots = slots.snapshots
    if snapshots is None:
        return []
    usable = next((k for k in range(len(hits), 0, -1) if hits[k - 1][1] in snapshots), 0)
    seq.snapshot_at = len(hits) * snapshots.block_size if usable < len(hits) else 0
    return hits[:usable]


def aligned_chunk(slots: StateSlots | None, seq: Sequence, num_computed: int, chunk: int) -> int:
    """A prefill chunk cut back to the last block boundary it crosses (snapshots on), or to
    ``seq.snapshot_at`` when it crosses that, so the state there can be kept; unchanged when it
    crosses no boundary."""
    if slots is None or slots.snapshots is None:
        return chunk
    if num_computed < seq.snapshot_at < num_computed + chunk:
        return seq.snapshot_at - num_computed
    end = (num_computed + chunk) // slots.snapshots.block_size * slots.snapshots.block_size
    return end - num_computed if end > num_computed else chunk


def take_snapshot(slots: StateSlots | None, seq: Sequence, num_new: int) -> None:
    """After a step: snapshot ``seq``'s state if its prefill chunk of ``num_new`` tokens ended on a
    block boundary that the prefix cache registered (``seq.last_hash`` names it)."""
    if slots is None or slots.snapshots is None or num_new < 2 or seq.state_slot is None:
        return
    at = seq.num_computed
    if at % slots.snapshots.block_size == 0 and seq.num_hashed * slots.snapshots.block_size == at:
        slots.snapshots.take(seq.state_slot, seq.last_hash)


def restore_snapshot(slots: StateSlots | None, seq: Sequence) -> None:
    """A sequence admitted with cached blocks starts its state from the snapshot at their end."""
    if slots is not None and seq.num_computed > 0:
        slots.snapshots.restore(seq.last_hash, seq.state_slot)
