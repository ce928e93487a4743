"""CPU decode tokens against a paged KV cache, read in place by the compiled kernel
``packing._paged_attention`` (csrc/paged_attention.cpp).

Why: in PyTorch each decode token costs a gather of its keys out of the blocks and one SDPA call,
per sequence per layer — measured as ~60% of a 64-sequence SmolLM2 decode step. The kernel does
one call per layer and copies nothing. It runs only where it is exact and needed: fp32 CPU
tensors, no autograd (generation), queries of length 1. Everything else (prefill chunks,
training, other dtypes, the extension missing) takes the PyTorch path, which stays the reference
the tests compare against.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from packing._native import load_extension
from packing.varlen import VarlenMeta

_SPLIT_MEMO: list = []  # [(meta, table, split)]: every layer of a step shares the split


def kernel() -> ModuleType | None:
    """The compiled kernel, or None (warned once) when it was not built."""
    return load_extension("packing._paged_attention", "paged decode attention", "PyTorch attention")


def usable(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: VarlenMeta) -> bool:
    """True when the kernel may serve this call exactly: fp32 CPU, no autograd, any decode token."""
    k_cache, v_cache = kv_cache
    if q.device.type != "cpu" or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return False
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or 1 not in meta.seqlens_q:
        return False
    return kernel() is not None


def split_step(meta: VarlenMeta, table: torch.Tensor):
    """``(decode seqs, their query rows, int32 block table rows, int32 key lengths, other seqs)``,
    computed once per step and shared by every layer."""
    if _SPLIT_MEMO and _SPLIT_MEMO[0][0] is meta and _SPLIT_MEMO[0][1] is table:
        return _SPLIT_MEMO[0][2]
    lq = np.asarray(meta.seqlens_q)
    decode = np.flatnonzero(lq == 1)
    others = np.flatnonzero(lq > 1).tolist()
    starts = np.concatenate(([0], np.cumsum(lq)[:-1]))
    rows = torch.from_numpy(starts[decode])
    table_np = np.ascontiguousarray(table.cpu().numpy()[decode], dtype=np.int32)
    lens = np.asarray(meta.seqlens_k, dtype=np.int32)[decode]
    split = (decode.tolist(), rows, table_np, lens, others)
    _SPLIT_MEMO[:] = [(meta, table, split)]
    return split


def attend_decode(
    q: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    table_rows: np.ndarray,
    lens: np.ndarray,
    *,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of decode queries ``q`` ``(n, heads, dim)`` over their cached keys."""
    q = q.detach().contiguous()
    out = torch.empty_like(q)
    k_cache, v_cache = kv_cache
    kernel().paged_decode(
        q.numpy(), k_cache.detach().numpy(), v_cache.detach().numpy(), table_rows, lens, out.numpy(),
        float(scale), float(softcap or 0.0), int(window or 0), torch.get_num_threads(),
    )
    return out
