"""The compiled attention kernel on generation steps (paged K/V, decode tokens and prefill chunks)
equals the PyTorch reference (per-sequence SDPA), in every dtype."""

import numpy as np
import pytest
import torch

from nopad.packing.attention import cpu_kernel as kernel_attention
from nopad.packing.attention import varlen_attention
from nopad.packing.varlen import VarlenMeta

pytestmark = pytest.mark.skipif(kernel_attention.kernel() is None, reason="extension not built")


def _paged_step(query_lens, context_lens, block_size, kv_heads, heads, dim=16, seed=0, dtype=torch.float32):
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
        [table[i, p // block_size].numpy().astype(np.int64) * block_size + p % block_size for i, p in enumerate(pos)]
    )
    meta = VarlenMeta.for_step(query_lens, context_lens, block_table=table, slot_mapping=torch.from_numpy(slots))
    total = sum(query_lens)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    cast = [t.to(dtype) for t in (q, k, v, k_cache, v_cache)]
    return cast[0], cast[1], cast[2], meta, (cast[3], cast[4])


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "block_size,dtype",
    [
        (1, torch.float32),
        (16, torch.float32),
        (256, torch.float32),
        (16, torch.bfloat16),
        (256, torch.bfloat16),
        (16, torch.float16),
    ],
)
@pytest.mark.parametrize("kv_heads,heads", [(1, 1), (2, 6), (4, 4)])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (None, 30.0), (5, 20.0)])
def test_decode_step_matches_reference(block_size, kv_heads, heads, window, softcap, dtype):
    query_lens = [1] * 7
    context_lens = [0, 1, 5, 16, 17, 40, 300]
    q, k, v, meta, cache = _paged_step(query_lens, context_lens, block_size, kv_heads, heads, dtype=dtype)
    opts = dict(sliding_window=window, softcap=softcap, softmax_scale=0.3)
    ref_cache = tuple(c.float() for c in cache)
    ref = varlen_attention(q.float(), k.float(), v.float(), meta, kv_cache=ref_cache, backend="sdpa_loop", **opts)
    with torch.no_grad():
        got = varlen_attention(q, k, v, meta, kv_cache=cache, **opts)
    assert got.dtype == dtype
    assert torch.equal(cache[0].float(), ref_cache[0])  # the new K/V were written the same way
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_decode_and_prefill_chunks(dtype):
    query_lens = [1, 9, 1, 4, 1, 40]
    context_lens = [20, 0, 3, 11, 0, 33]
    q, k, v, meta, cache = _paged_step(query_lens, context_lens, 4, 2, 4, dtype=dtype)
    ref = varlen_attention(
        q.float(), k.float(), v.float(), meta, kv_cache=tuple(c.float() for c in cache), backend="sdpa_loop"
    )
    with torch.no_grad():
        got = varlen_attention(q, k, v, meta, kv_cache=cache)
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_gradients_flow_through_a_paged_step():
    q, k, v, meta, cache = _paged_step([1, 3], [3, 4], 2, 1, 2)
    q.requires_grad_(True)
    out = varlen_attention(q, k, v, meta, kv_cache=cache)
    ref_q = q.detach().clone().requires_grad_(True)
    ref = varlen_attention(ref_q, k, v, meta, kv_cache=cache, backend="sdpa_loop")
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad, atol=1e-5, rtol=1e-5)


def test_bad_block_table_is_an_error_not_a_crash():
    q, k, v, meta, cache = _paged_step([1], [5], 2, 1, 1)
    table = torch.tensor([[0, 1, 10**6]], dtype=torch.int32)
    flat = [c.view(-1, *c.shape[2:]) for c in cache]
    with pytest.raises(ValueError, match="block id out of range"):
        kernel_attention.forward(
            q, *flat, VarlenMeta.for_step([1], [5], block_table=table), table=table, block_size=2, scale=1.0
        )
    with pytest.raises(ValueError, match="out of range"):
        kernel_attention.forward(q, k, v, VarlenMeta.for_step([1], [5]), scale=1.0)


def test_unsupported_dtype_is_a_clear_error():
    q = torch.ones(4, 2, 16, dtype=torch.int32)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        kernel_attention.forward(q, q[:, :1], q[:, :1], VarlenMeta.from_lengths([4]), scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("group,dim", [(1, 64), (3, 64), (8, 64), (1, 128), (3, 128), (8, 128), (3, 72)])
def test_decode_matches_sdpa_for_head_shapes(group, dim, block_size, dtype):
    """GQA group sizes of real models (1, SmolLM2's 3, 8) and head dims of a whole number of the
    kernel's 16 lanes and not (72), with keys read in place from small and large KV blocks."""
    context_lens = [0, 31, 32, 33, 290]
    q, k, v, meta, cache = _paged_step(
        [1] * len(context_lens), context_lens, block_size, 2, 2 * group, dim=dim, dtype=dtype
    )
    ref = varlen_attention(
        q.float(), k.float(), v.float(), meta, kv_cache=tuple(c.float() for c in cache), backend="sdpa_loop"
    )
    with torch.no_grad():
        got = varlen_attention(q, k, v, meta, kv_cache=cache, backend="kernel")
    torch.testing.assert_close(got.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 72])
def test_decode_path_and_block_path_give_the_same_bits(dtype, dim):
    """A whole sequence at once (8 tokens x 8 heads of a group: the transposed-block path) equals
    each token as its own decode query (the per-key path), bit for bit."""
    gen = torch.Generator().manual_seed(3)
    n, heads, kv_heads = 70, 16, 2  # 8 tokens x 8 heads of a group: the transposed path
    q, k, v = (torch.randn(n, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    whole = kernel_attention.forward(q, k, v, VarlenMeta.from_lengths([n]), scale=0.2, softcap=30.0)
    one_by_one = torch.cat(
        [
            kernel_attention.forward(
                q[t : t + 1], k[: t + 1], v[: t + 1], VarlenMeta.for_step([1], [t]), scale=0.2, softcap=30.0
            )
            for t in range(n)
        ]
    )
    assert torch.equal(whole, one_by_one)


@pytest.mark.skipif(
    kernel_attention.kernel() is None or kernel_attention.kernel().isa() != "avx512",
    reason="needs a CPU with AVX-512 to compare its path with the portable one",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 72])
@pytest.mark.parametrize("kv_heads,heads", [(2, 6), (1, 8)])
@pytest.mark.parametrize("window,softcap,sinks", [(25, None, False), (None, 20.0, False), (25, None, True)])
def test_portable_and_avx512_paths_give_the_same_bits(dtype, dim, kv_heads, heads, window, softcap, sinks):
    """Decode tokens (the per-key path), short chunks and 70-token chunks over cached keys (the
    rows path: 16 query rows per vector), with a window, a softcap or attention sinks."""
    q, k, v, meta, cache = _paged_step([1, 9, 1, 20, 70], [40, 0, 3, 33, 50], 4, kv_heads, heads, dim=dim, dtype=dtype)
    flat = [c.view(-1, *c.shape[2:]) for c in cache]
    ext = kernel_attention.kernel()
    runs = []
    try:
        for portable in (False, True):
            ext.set_portable(portable)
            runs.append(
                kernel_attention.forward(
                    q,
                    *flat,
                    meta,
                    table=meta.block_table,
                    block_size=4,
                    scale=0.3,
                    window=window,
                    softcap=softcap,
                    sinks=torch.linspace(-2, 3, heads) if sinks else None,
                )
            )
    finally:
        ext.set_portable(False)
    assert torch.equal(runs[0], runs[1])
