"""Varlen attention: one function for a packed training row and a paged generation step.

Tensors are flat, shaped ``(total_tokens, heads, head_dim)``; ``meta`` says where each sequence
starts. Keys may be longer than queries (cached context); the causal mask is aligned to the end
of each sequence's keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from packing.varlen import VarlenMeta


def store_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V ``(T, kv_heads, dim)`` into a paged cache
    ``(num_blocks, block_size, kv_heads, dim)`` at flat slots ``block * block_size + offset``."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, meta: VarlenMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's keys out of a paged cache into flat ``(total_k, kv_heads, dim)``."""
    k_cache, v_cache = kv_cache
    block_size = k_cache.shape[1]
    slots = []
    for i, n in enumerate(meta.seqlens_k):
        pos = torch.arange(n, device=block_table.device)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    slot = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    return flat_k.index_select(0, slot), flat_v.index_select(0, slot)


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Exact attention for one sequence: q ``(Lq, H, D)``, k/v ``(Lk, Hkv, D)``."""
    lq, lk = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)  # (H, Lq, D)
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    mask = None
    if causal or sliding_window is not None:
        q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        k_pos = torch.arange(lk, device=q.device)[None, :]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if causal:
            mask &= k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    if softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, vh)
    return out.transpose(0, 1)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    meta: VarlenMeta,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a flat varlen row; returns ``(total_q, heads, head_dim)``.

    ``k``/``v`` are the keys of this row, or, with ``kv_cache``, the new tokens' keys, which are
    first written to the cache at ``meta.slot_mapping``; keys are then read through
    ``block_table`` (default ``meta.block_table``). ``sliding_window=W`` lets a query at position
    ``p`` see keys ``p - W < j <= p``.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (total_tokens, heads, head_dim), got shape {tuple(q.shape)}")
    if q.shape[0] != meta.total_q:
        raise ValueError(f"q has {q.shape[0]} tokens but meta describes {meta.total_q}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if kv_cache is not None:
        table = block_table if block_table is not None else meta.block_table
        if table is None:
            raise ValueError("kv_cache needs a block_table (argument or meta.block_table)")
        if k is not None:
            if meta.slot_mapping is None:
                raise ValueError("new K/V given with kv_cache but meta.slot_mapping is None")
            store_kv(kv_cache, k, v, meta.slot_mapping)
        k, v = gather_kv(kv_cache, table, meta)
    if k is None or v is None:
        raise ValueError("k and v are required when no kv_cache is given")
    if k.shape[0] != meta.total_k:
        raise ValueError(f"k has {k.shape[0]} tokens but meta describes {meta.total_k}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    out = torch.empty_like(q)
    q_start = k_start = 0
    for lq, lk in zip(meta.seqlens_q, meta.seqlens_k):
        if lq:
            out[q_start : q_start + lq] = _attend_one(
                q[q_start : q_start + lq],
                k[k_start : k_start + lk],
                v[k_start : k_start + lk],
                causal=causal,
                scale=scale,
                sliding_window=sliding_window,
                softcap=softcap,
            )
        q_start += lq
        k_start += lk
    return out
