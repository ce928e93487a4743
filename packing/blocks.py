"""The block allocator: nopad's one piece of memory bookkeeping for paged K/V.

Pure bookkeeping, no torch: the generator's KV cache owns the tensors and asks this class which
block ids to use. Blocks are fixed-size; allocate and free are O(1). Blocks carry reference
counts so sequences can share them (prefix sharing, the ``n`` samples of one prompt) and be
copied on first write. A full block may be registered under a content hash chained from its
parent block's hash, so a later sequence with the same prefix finds it again; a hit also compares
the tokens, so a hash collision never returns wrong K/V. Freed blocks that carry a hash stay
findable until their memory is needed, then the least recently freed is evicted first;
``on_forget(hash)`` hears of every hash the cache drops (the generator's state snapshots of hybrid
models live and die with their block).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence

NO_PARENT = -1  # parent hash of a sequence's first block


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than are left."""

    def __init__(self, needed: int, free: int, num_blocks: int, block_size: int):
        self.needed, self.free, self.num_blocks = needed, free, num_blocks
        super().__init__(
            f"needed {needed} KV blocks but only {free} of {num_blocks} are free "
            f"(block_size={block_size} tokens). Give the cache more memory (num_blocks or "
            f"kv_memory_bytes), or lower max_num_seqs / max_num_batched_tokens, or free blocks "
            f"held by finished sequences first."
        )


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """Content hash of a full block, chained on its parent's so equal blocks at different
    prefixes differ. Deterministic across processes (ints and tuples hash without salt)."""
    return hash((parent_hash, tuple(tokens)))


class BlockAllocator:
    """Fixed-size blocks with reference counts, copy-on-write and a content-hash prefix cache."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # oldest-freed first (LRU)
        self.hits = 0
        self.evictions = 0
        self.on_forget: Callable[[int], None] | None = None

    # ----------------------------------------------------------------- sizes
    @property
    def num_free(self) -> int:
        """Blocks available to allocate (including free blocks still holding cached content)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered under a content hash (in use or free)."""
        return len(self._hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- allocate / free
    def allocate(self) -> int:
        """One block with reference count 1 and no content hash."""
        if self._free_uncached:
            block = self._free_uncached.popleft()
        elif self._free_cached:
            block, _ = self._free_cached.popitem(last=False)
            self._forget_hash(block)
            self.evictions += 1
        else:
            raise OutOfBlocksError(1, 0, self.num_blocks, self.block_size)
        self.ref_count[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks, all or nothing."""
        if n > self.num_free:
            raise OutOfBlocksError(n, self.num_free, self.num_blocks, self.block_size)
        free = self._free_uncached
        if len(free) < n:  # some come from the cached free blocks (evictions): one at a time
            return [self.allocate() for _ in range(n)]
        blocks = [free.popleft() for _ in range(n)]  # (no call per block: a decode batch's rows grow together)
        ref_count = self.ref_count
        for block in blocks:
            ref_count[block] = 1
        return blocks

    def share(self, block: int) -> int:
        """Add an owner to ``block`` (it may be a free block still holding cached content)."""
        if self.ref_count[block] == 0:
            if block not in self._free_cached:
                raise ValueError(f"block {block} is free and holds no cached content; allocate instead")
            del self._free_cached[block]
        self.ref_count[block] += 1
        return block

    def free(self, block: int) -> None:
        """Drop one owner; at zero the block is free (and stays findable if it has a hash)."""
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} freed more times than it was allocated or shared")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self._block_hash[block] is None:
                self._free_uncached.append(block)
            else:
                self._free_cached[block] = None  # most recently freed: evicted last

    def free_all(self, blocks: Iterable[int]) -> None:
        """Free a sequence's blocks, last first, so its tail is evicted before its prefix."""
        for block in reversed(list(blocks)):
            self.free(block)

    def copy_on_write(self, block: int) -> tuple[int, int | None]:
        """Make ``block`` writable by its caller: returns ``(block_to_write, copy_from)``.

        If others share the block the caller gets a fresh block and must copy ``copy_from``'s
        contents into it before writing; otherwise ``copy_from`` is None and it writes in place.
        """
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if self.ref_count[block] == 1:
            if self._block_hash[block] is not None:
                raise ValueError(f"block {block} is full and registered under a hash; it is read-only")
            return block, None
        new = self.allocate()
        self.free(block)
        return new, block

    # ----------------------------------------------------------------- prefix cache
    def lookup(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """The block holding exactly ``tokens`` under ``block_hash``, or None. No side effects."""
        block = self._hash_to_block.get(block_hash)
        if block is None or self._block_tokens[block] != tuple(tokens):
            return None
        return block

    def acquire_cached(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """Share the cached block holding ``tokens`` (counted as a hit), or return None."""
        block = self.lookup(block_hash, tokens)
        if block is None:
            return None
        self.hits += 1
        return self.share(block)

    def register(self, block: int, block_hash: int, tokens: Sequence[int]) -> bool:
        """Record that the in-use, now full ``block`` holds ``tokens`` (so later prefixes can
        reuse it). Returns False when another block already holds this content (kept as is)."""
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} of {self.block_size} tokens")
        if self._block_hash[block] is not None:
            if self._block_hash[block] == block_hash:
                return True
            raise ValueError(f"block {block} is already registered under another hash")
        if block_hash in self._hash_to_block:
            return False
        self._block_hash[block] = block_hash
        self._block_tokens[block] = tuple(tokens)
        self._hash_to_block[block_hash] = block
        return True

    def block_hash(self, block: int) -> int | None:
        return self._block_hash[block]

    def reset_prefix_cache(self) -> None:
        """Forget all content hashes (e.g. after the weights changed, cached K/V is stale)."""
        for block in list(self._hash_to_block.values()):
            self._forget_hash(block)
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()

    def _forget_hash(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            del self._hash_to_block[h]
            self._block_hash[block] = None
            self._block_tokens[block] = None
            if self.on_forget is not None:
                self.on_forget(h)

    # ----------------------------------------------------------------- invariants
    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "free": self.num_free,
            "used": self.num_used,
            "cached": self.num_cached,
            "hits": self.hits,
            "evictions": self.evictions,
        }

    def check(self, owners: Iterable[Sequence[int]] | None = None) -> None:
        """Verify every invariant; raise AssertionError naming the first broken one.

        ``owners``: the block lists of every live owner (e.g. each sequence's block table); when
        given, each block's reference count must equal how many times the owners hold it.
        """
        uncached = list(self._free_uncached)
        cached = list(self._free_cached)
        free_set = set(uncached) | set(cached)
        assert len(uncached) + len(cached) == len(free_set), "a block is on a free list twice"
        for b in range(self.num_blocks):
            rc = self.ref_count[b]
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free_set), f"block {b}: refcount {rc} but free={b in free_set}"
            h = self._block_hash[b]
            assert (h is None) == (self._block_tokens[b] is None), f"block {b}: hash without tokens"
            if h is not None:
                assert self._hash_to_block.get(h) == b, f"block {b}: hash map does not point back"
                assert len(self._block_tokens[b]) == self.block_size, f"block {b}: partial tokens"
        for b in uncached:
            assert self._block_hash[b] is None, f"free block {b} has a hash but is not in the cache LRU"
        for b in cached:
            assert self._block_hash[b] is not None, f"cached free block {b} has no hash"
        for h, b in self._hash_to_block.items():
            assert self._block_hash[b] == h, f"hash map entry for block {b} is stale"
        if owners is not None:
            counts = [0] * self.num_blocks
            for blocks in owners:
                for b in blocks:
                    counts[b] += 1
            for b in range(self.num_blocks):
                assert counts[b] == self.ref_count[b], (
                    f"block {b}: refcount {self.ref_count[b]} but held by {counts[b]} owners"
                )

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, cached={self.num_cached})"
        )
