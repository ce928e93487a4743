"""Exactness of every varlen attention backend against a naive per-sequence reference, including
paged K/V (random block tables, block sizes 1/16/256), decode and chunked prefill. The flash-attn
dispatch is tested against a strict stand-in in tests/packing/test_packing_precision.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nopad.packing.attention import gather_kv, store_kv, varlen_attention
from nopad.packing.varlen import VarlenMeta

H, HKV, D = 4, 2, 8
CPU_BACKENDS = ("auto", "sdpa_loop", "sdpa_padded", "sdpa_dense")


pytestmark = pytest.mark.usefixtures("one_thread")


def naive(q, k, v, meta, *, causal=True, scale=None, window=None, softcap=None):
    """Explicit maths, one sequence at a time, no SDPA."""
    scale = scale or 1 / math.sqrt(q.shape[-1])
    outs = []
    cq, ck = meta.cu_seqlens_q.tolist(), meta.cu_seqlens_k.tolist()
    for i, (lq, lk) in enumerate(zip(meta.seqlens_q, meta.seqlens_k)):
        qi = q[cq[i] : cq[i] + lq].transpose(0, 1)
        ki = k[ck[i] : ck[i] + lk].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0)
        vi = v[ck[i] : ck[i] + lk].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], 0)
        s = qi @ ki.transpose(-1, -2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp = torch.arange(lk - lq, lk)[:, None]
        kp = torch.arange(lk)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            keep &= kp <= qp
        if window:
            keep &= kp > qp - window
        outs.append((s.masked_fill(~keep, -math.inf).softmax(-1) @ vi).transpose(0, 1))
    return torch.cat(outs)


def rand(n, heads, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, heads, D, generator=g, dtype=torch.float64).float()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(
    "window,softcap",
    [(None, None), (5, None), (None, 3.0), (5, 3.0)],
    ids=["plain", "window", "softcap", "both"],
)
def test_training_row_forward_and_backward(backend, window, softcap):
    lengths = [1, 7, 16, 3, 1, 12]  # includes length-1 sequences and ones longer than the window
    meta = VarlenMeta.from_lengths(lengths)
    q, k, v = (rand(meta.total_q, H, 0), rand(meta.total_k, HKV, 1), rand(meta.total_k, HKV, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, meta, sliding_window=window, softcap=softcap, backend=backend)
    ref = naive(*ref_leaves, meta, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = rand(meta.total_q, H, 3)
    (out * grad).sum().backward()
    (ref * grad).sum().backward()
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_queries_shorter_than_keys_align_to_the_end(backend):
    # decode tokens (q=1), a prefill chunk on top of context, and a fresh prefill in one step
    meta = VarlenMeta.for_step([1, 4, 6, 1], [9, 5, 0, 2])
    q, k, v = rand(meta.total_q, H, 4), rand(meta.total_k, HKV, 5), rand(meta.total_k, HKV, 6)
    for window in (None, 3):
        out = varlen_attention(q, k, v, meta, sliding_window=window, backend=backend)
        torch.testing.assert_close(out, naive(q, k, v, meta, window=window), atol=1e-5, rtol=1e-5)


def _paged(meta, k, v, block_size, seed):
    """Scatter contiguous K/V into a cache with a random block table; return cache, table."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-n // block_size) for n in meta.seqlens_k]
    num_blocks = sum(blocks_per_seq) + 3
    perm = rng.permutation(num_blocks)
    table = torch.zeros(meta.num_seqs, max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = torch.from_numpy(perm[start : start + nb])
        start += nb
    cache = (torch.full((num_blocks, block_size, HKV, D), float("nan")),) * 2
    cache = tuple(c.clone() for c in cache)
    lens = torch.tensor(meta.seqlens_k)
    seq = torch.repeat_interleave(torch.arange(meta.num_seqs), lens)
    pos = torch.arange(meta.total_k) - meta.cu_seqlens_k.long()[seq]
    slots = table[seq, pos // block_size].long() * block_size + pos % block_size
    store_kv(cache, k, v, slots)
    return cache, table, slots


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_paged_kv_equals_contiguous(block_size, backend):
    meta = VarlenMeta.for_step([1, 5, 1, 20, 1], [30, 7, 0, 0, 299])
    q, k, v = rand(meta.total_q, H, 7), rand(meta.total_k, HKV, 8), rand(meta.total_k, HKV, 9)
    cache, table, _ = _paged(meta, k, v, block_size, seed=block_size)
    gk, gv = gather_kv(cache, table, meta)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    for window, softcap in ((None, None), (4, 2.0)):
        out = varlen_attention(
            q,
            None,
            None,
            meta,
            kv_cache=cache,
            block_table=table,
            sliding_window=window,
            softcap=softcap,
            backend=backend,
        )
        ref = varlen_attention(q, k, v, meta, sliding_window=window, softcap=softcap, backend="sdpa_loop")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_new_kv_is_stored_at_slot_mapping_then_attended(backend):
    """Generator contract: pass this step's K/V with kv_cache; they land at meta.slot_mapping."""
    context = [6, 0, 17]
    query = [1, 9, 1]
    full = VarlenMeta.for_step(query, context)
    k, v = rand(full.total_k, HKV, 10), rand(full.total_k, HKV, 11)
    q = rand(full.total_q, H, 12)
    cache, table, slots = _paged(full, k, v, 16, seed=3)
    # wipe the new tokens' slots, then hand their K/V in as this step's keys
    cu_k = full.cu_seqlens_k.tolist()
    new_rows = torch.cat([torch.arange(cu_k[i] + context[i], cu_k[i + 1]) for i in range(3)])
    for c in cache:
        c.view(-1, HKV, D)[slots[new_rows]] = float("nan")
    meta = VarlenMeta.for_step(query, context, block_table=table, slot_mapping=slots[new_rows])
    out = varlen_attention(q, k[new_rows], v[new_rows], meta, kv_cache=cache, backend=backend)
    torch.testing.assert_close(out, naive(q, k, v, full), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa_loop", "sdpa_padded"])
def test_decode_batch_is_exact_and_differentiable(backend):
    meta = VarlenMeta.for_step([1] * 6, [3, 40, 1, 0, 12, 7])
    q, k, v = (
        rand(meta.total_q, H, 13).requires_grad_(),
        rand(meta.total_k, HKV, 14).requires_grad_(),
        rand(meta.total_k, HKV, 15).requires_grad_(),
    )
    out = varlen_attention(q, k, v, meta, backend=backend)
    torch.testing.assert_close(out, naive(q, k, v, meta), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(k.grad).all() and torch.isfinite(q.grad).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_forward_matches():
    meta = VarlenMeta.from_lengths([5, 1, 11])
    q, k, v = rand(meta.total_q, H, 16), rand(meta.total_k, HKV, 17), rand(meta.total_k, HKV, 18)
    with torch.no_grad():
        out = varlen_attention(q, k, v, meta, sliding_window=4, backend="flex")
    torch.testing.assert_close(out, naive(q, k, v, meta, window=4), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no backward on CPU"):
        varlen_attention(q.requires_grad_(), k, v, meta, backend="flex")


def test_clear_errors():
    meta = VarlenMeta.from_lengths([3, 2])
    q, k = rand(5, H, 0), rand(5, HKV, 1)
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(q, k, k, meta, backend="fast")
    with pytest.raises(ValueError, match="q has 4 tokens"):
        varlen_attention(q[:4], k, k, meta)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        varlen_attention(q, rand(5, 3, 1), rand(5, 3, 1), meta)
    with pytest.raises(ValueError, match="needs a block_table"):
        varlen_attention(q, None, None, meta, kv_cache=(torch.zeros(2, 4, HKV, D),) * 2)
