"""The compiled paged decode kernel equals the PyTorch reference (per-sequence SDPA)."""

import numpy as np
import pytest
import torch

from packing import paged_decode
from packing.attention import varlen_attention
from packing.varlen import VarlenMeta

pytestmark = pytest.mark.skipif(paged_decode.kernel() is None, reason="extension not built")


def _paged_step(query_lens, context_lens, block_size, kv_heads, heads, dim=16, seed=0):
    """A random paged cache holding every sequence's context + new tokens, in shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    key_lens = [q + c for q, c in zip(query_lens, context_lens)]
    need = [-(-n // block_size) for n in key_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = order[used : used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    pos = [np.arange(c, c + q) for q, c in zip(query_lens, context_lens)]
    slots = np.concatenate(
        [table[i, p // block_size].numpy().astype(np.int64) * block_size + p % block_size
         for i, p in enumerate(pos)]
    )
    meta = VarlenMeta.for_step(
        query_lens, context_lens, block_table=table, slot_mapping=torch.from_numpy(slots)
    )
    total = sum(query_lens)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    return q, k, v, meta, (k_cache, v_cache)


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 6), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0), (5, 20.0)])
def test_decode_step_matches_reference(block_size, kv_heads, heads, window, softcap):
    query_lens = [1] * 7
    context_lens = [0, 1, 5, 16, 17, 40, 300]
    q, k, v, meta, cache = _paged_step(query_lens, context_lens, block_size, kv_heads, heads)
    opts = dict(sliding_window=window, softcap=softcap, softmax_scale=0.3)
    ref_cache = tuple(c.clone() for c in cache)
    ref = varlen_attention(q, k, v, meta, kv_cache=ref_cache, backend="sdpa_loop", **opts)
    with torch.no_grad():
        got = varlen_attention(q, k, v, meta, kv_cache=cache, **opts)
    assert torch.equal(cache[0], ref_cache[0])  # the new K/V were written the same way
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_mixed_step_decode_and_prefill_chunks():
    query_lens = [1, 9, 1, 4, 1]
    context_lens = [20, 0, 3, 11, 0]
    q, k, v, meta, cache = _paged_step(query_lens, context_lens, 4, 2, 4)
    ref = varlen_attention(q, k, v, meta, kv_cache=tuple(c.clone() for c in cache), backend="sdpa_loop")
    with torch.no_grad():
        got = varlen_attention(q, k, v, meta, kv_cache=cache)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_kernel_is_skipped_when_autograd_needs_it():
    q, k, v, meta, cache = _paged_step([1, 1], [3, 4], 2, 1, 2)
    q.requires_grad_(True)
    assert not paged_decode.usable(q, cache, meta)
    out = varlen_attention(q, k, v, meta, kv_cache=cache)
    out.sum().backward()  # the PyTorch path ran: gradients flow
    assert q.grad is not None


def test_bad_block_table_is_an_error_not_a_crash():
    q, k, v, meta, cache = _paged_step([1], [5], 2, 1, 1)
    table = np.array([[0, 1, 10**6]], dtype=np.int32)
    with pytest.raises(ValueError, match="block id out of range"):
        paged_decode.attend_decode(
            q, cache, table, np.array([6], dtype=np.int32), scale=1.0, window=None, softcap=None
        )


def test_reference_split_matches_meta():
    q, k, v, meta, cache = _paged_step([1, 3, 1], [2, 0, 5], 2, 1, 1)
    decode, rows, table_rows, lens, others = paged_decode.split_step(meta, meta.block_table)
    assert decode == [0, 2] and others == [1]
    assert rows.tolist() == [0, 4] and lens.tolist() == [3, 6]
    assert table_rows.dtype == np.int32
    assert table_rows.tolist() == meta.block_table[[0, 2]].tolist()
