"""Tests of nopad.packing.blocks: the allocator's bookkeeping under every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nopad.packing.blocks import NO_PARENT, BlockAllocator, OutOfBlocksError, hash_block


def test_allocate_free_order_and_counts():
    a = BlockAllocator(4, block_size=2)
    assert [a.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert a.num_free == 0
    with pytest.raises(OutOfBlocksError, match=r"needed 1 KV blocks but only 0 of 4 are free"):
        a.allocate()
    a.free(2)
    a.free(0)
    assert a.allocate() == 2  # FIFO free list
    a.check(owners=[[1, 2, 3]])


def test_allocate_many_is_all_or_nothing():
    a = BlockAllocator(3, block_size=4)
    a.allocate()
    with pytest.raises(OutOfBlocksError) as err:
        a.allocate_many(3)
    assert err.value.needed == 3 and err.value.free == 2
    assert "num_blocks or kv_memory_bytes" in str(err.value)
    assert a.num_free == 2


def test_double_free_is_an_error():
    a = BlockAllocator(2, block_size=4)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="freed more times"):
        a.free(b)


def test_copy_on_write():
    a = BlockAllocator(3, block_size=4)
    b = a.allocate()
    assert a.copy_on_write(b) == (b, None)  # sole owner writes in place
    a.share(b)
    new, src = a.copy_on_write(b)
    assert src == b and new != b
    assert a.ref_count[b] == 1 and a.ref_count[new] == 1
    a.check(owners=[[b], [new]])


def test_prefix_cache_hit_needs_equal_tokens():
    a = BlockAllocator(4, block_size=2)
    b = a.allocate()
    h = hash_block(NO_PARENT, [5, 6])
    assert a.register(b, h, [5, 6])
    assert a.lookup(h, [5, 7]) is None  # a colliding hash with other tokens is not a hit
    assert a.acquire_cached(h, [5, 6]) == b
    assert a.ref_count[b] == 2 and a.hits == 1
    a.free(b)
    with pytest.raises(ValueError, match="read-only"):
        a.copy_on_write(b)


def test_register_duplicate_content_keeps_first():
    a = BlockAllocator(4, block_size=2)
    b1, b2 = a.allocate(), a.allocate()
    h = hash_block(NO_PARENT, [1, 2])
    assert a.register(b1, h, [1, 2])
    assert not a.register(b2, h, [1, 2])
    assert a.block_hash(b2) is None
    with pytest.raises(ValueError, match="only full blocks"):
        a.register(b2, 7, [1])
    a.check()


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    a = BlockAllocator(3, block_size=1)
    blocks = [a.allocate() for _ in range(3)]
    hashes = [hash_block(NO_PARENT, [t]) for t in range(3)]
    for b, h, t in zip(blocks, hashes, range(3)):
        a.register(b, h, [t])
    a.free(blocks[1])
    a.free(blocks[0])
    a.free(blocks[2])
    assert a.num_free == 3 and a.num_cached == 3
    assert a.acquire_cached(hashes[0], [0]) == blocks[0]  # revived from the free list
    assert a.num_free == 2
    assert a.allocate() == blocks[1]  # least recently freed is evicted first
    assert a.evictions == 1 and a.lookup(hashes[1], [1]) is None
    assert a.lookup(hashes[2], [2]) == blocks[2]
    a.check(owners=[[blocks[0]], [blocks[1]]])


def test_reset_prefix_cache():
    a = BlockAllocator(2, block_size=1)
    b = a.allocate()
    a.register(b, 11, [3])
    a.free(b)
    a.reset_prefix_cache()
    assert a.num_cached == 0 and a.lookup(11, [3]) is None and a.num_free == 2
    a.check()


def test_hash_chain_depends_on_parent():
    assert hash_block(NO_PARENT, [1, 2]) != hash_block(hash_block(NO_PARENT, [0, 0]), [1, 2])


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockAllocator(4, 0)


def test_check_detects_refcount_owner_mismatch():
    a = BlockAllocator(2, block_size=1)
    b = a.allocate()
    with pytest.raises(AssertionError, match="held by 2 owners"):
        a.check(owners=[[b], [b]])


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / share / free / copy-on-write / register / lookup sequences against a
    plain model of who owns which block; ``check()`` after every operation."""

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(num_blocks=8, block_size=2)
        self.owners: list[list[int]] = []  # each owner holds a list of blocks
        self.content: dict[int, tuple[int, ...]] = {}  # hash -> tokens registered under it

    @rule(n=st.integers(1, 4))
    def allocate(self, n):
        if n > self.alloc.num_free:
            with pytest.raises(OutOfBlocksError):
                self.alloc.allocate_many(n)
        else:
            self.owners.append(self.alloc.allocate_many(n))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def share(self, i):
        blocks = self.owners[i % len(self.owners)]
        self.owners.append([self.alloc.share(b) for b in blocks])

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.alloc.free_all(self.owners.pop(i % len(self.owners)))

    @precondition(lambda self: self.owners)
    @rule(i=st.integers(0, 100), j=st.integers(0, 100))
    def write(self, i, j):
        blocks = self.owners[i % len(self.owners)]
        k = j % len(blocks)
        if self.alloc.block_hash(blocks[k]) is not None and self.alloc.ref_count[blocks[k]] == 1:
            return  # a registered full block is read-only
        if self.alloc.ref_count[blocks[k]] > 1 and self.alloc.num_free == 0:
            return
        new, src = self.alloc.copy_on_write(blocks[k])
        assert (src is None) == (new == blocks[k])
        blocks[k] = new

    @precondition(lambda self: self.owners)
    @rule(
        i=st.integers(0, 100),
        tokens=st.tuples(st.integers(0, 3), st.integers(0, 3)),
        parent=st.sampled_from([NO_PARENT, 1, 2]),
    )
    def register(self, i, tokens, parent):
        block = self.owners[i % len(self.owners)][0]
        h = hash_block(parent, tokens)
        existing = self.alloc.block_hash(block)
        if existing is not None and existing != h:
            with pytest.raises(ValueError):
                self.alloc.register(block, h, tokens)
            return
        taken = h in self.content and self.alloc.lookup(h, self.content[h]) not in (None, block)
        ok = self.alloc.register(block, h, tokens)
        assert ok == (not taken)
        if ok:
            self.content[h] = tuple(tokens)

    @rule(tokens=st.tuples(st.integers(0, 3), st.integers(0, 3)), parent=st.sampled_from([NO_PARENT, 1, 2]))
    def reuse(self, tokens, parent):
        h = hash_block(parent, tokens)
        hits = self.alloc.hits
        block = self.alloc.acquire_cached(h, tokens)
        if block is None:
            assert self.alloc.hits == hits
        else:
            assert self.alloc.hits == hits + 1 and self.alloc.block_hash(block) == h
            self.owners.append([block])

    @rule()
    def reset(self):
        self.alloc.reset_prefix_cache()
        self.content.clear()

    @invariant()
    def consistent(self):
        self.alloc.check(owners=self.owners)
        used = {b for blocks in self.owners for b in blocks}
        assert self.alloc.num_used == len(used)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_all_free_after_everything_released():
    a = BlockAllocator(5, block_size=2)
    x = a.allocate_many(3)
    a.register(x[0], hash_block(NO_PARENT, [1, 1]), [1, 1])
    y = [a.share(b) for b in x[:2]]
    a.free_all(x)
    a.free_all(y)
    assert a.num_free == 5
    a.check(owners=[])
