"""Thin dispatch to flash-attn 2's ``flash_attn_varlen_func`` (CUDA only).

The arguments follow flash-attn's documented contract (``flash_attn/flash_attn_interface.py``):
``cu_seqlens_q/k`` int32 ``[batch + 1]``, ``max_seqlen_q/k`` Python ints, ``causal`` aligned to the
bottom-right corner (so queries shorter than keys attend to the end of their keys), sliding
window as ``window_size=(left, right)`` with ``(-1, -1)`` meaning unlimited, ``softcap=0.0``
meaning off, and paged K/V as ``k``/``v`` shaped ``(num_blocks, page_block_size, kv_heads, dim)``
plus an int32 ``block_table`` — which FA2's varlen kernel only accepts when the page size is a
multiple of 256. Smaller pages are gathered into contiguous K/V first.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from packing.varlen import VarlenMeta

FA2_PAGE_MULTIPLE = 256


def flash_attn_available() -> bool:
    """True when flash-attn is importable (without importing its CUDA extension eagerly)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):
        return False


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """Our ``sliding_window=W`` (a query sees itself and the W-1 keys before it) in flash-attn's
    ``(left, right)`` form."""
    return (-1, -1) if sliding_window is None else (sliding_window - 1, 0)


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    causal: bool,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` on flat ``k``/``v`` (``(total_k, kv_heads, dim)``) or, with
    ``block_table``, on a paged cache whose page size is a multiple of 256."""
    flash_attn = importlib.import_module("flash_attn")
    kwargs = {}
    if block_table is not None:
        if k.shape[1] % FA2_PAGE_MULTIPLE:
            raise ValueError(
                f"flash-attn's paged varlen kernel needs a block size that is a multiple of "
                f"{FA2_PAGE_MULTIPLE}, got {k.shape[1]}; gather the K/V first"
            )
        kwargs["block_table"] = block_table.to(torch.int32).contiguous()
    return flash_attn.flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=meta.cu_seqlens_q.to(torch.int32),
        cu_seqlens_k=meta.cu_seqlens_k.to(torch.int32),
        max_seqlen_q=int(meta.max_seqlen_q),
        max_seqlen_k=int(meta.max_seqlen_k),
        dropout_p=0.0,
        softmax_scale=float(scale),
        causal=bool(causal),
        window_size=window_size(sliding_window),
        softcap=0.0 if softcap is None else float(softcap),
        **kwargs,
    )
