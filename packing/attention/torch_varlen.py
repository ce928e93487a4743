"""PyTorch's own FlashAttention-2 varlen kernel, ``torch.nn.attention.varlen.varlen_attn``: the
CUDA fast path with nothing to build (flash-attn is a long source build).

What a torch version accepts is read off the installed function's signature, never assumed:
torch 2.9 has ``is_causal`` and no ``scale``; 2.10 adds ``scale`` and ``window_size``; 2.12 makes
the options keyword-only, spells causal as ``window_size=(-1, 0)`` and adds ``enable_gqa``,
``seqused_k`` and ``block_table`` (paged K/V ``(pages, page_size, kv_heads, dim)``, inference
only). The kernel takes fp16/bf16 on an Ampere or newer GPU, int32 ``cu_seq_q/k``, head dim <= 256,
and has no softcap. Paged K/V are read in place only for pages that are a multiple of 256 tokens
(the vendored FlashAttention-2 check); smaller pages go to nopad's Triton kernel.
"""

from __future__ import annotations

import functools
import inspect

import torch

from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta

DTYPES = (torch.float16, torch.bfloat16)
PAGE_MULTIPLE = 256
MAX_HEAD_DIM = 256


def varlen_attn():
    """The installed ``varlen_attn``, or None. Looked up at each call so a test can replace it."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    return getattr(varlen, "varlen_attn", None)


@functools.lru_cache(maxsize=4)
def _params(func) -> frozenset:
    return frozenset(inspect.signature(func).parameters)


def params() -> frozenset:
    """Parameter names of the installed ``varlen_attn`` (empty when there is none)."""
    func = varlen_attn()
    return frozenset() if func is None else _params(func)


def window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """Our ``causal`` / ``sliding_window=W`` as FlashAttention's ``(left, right)``."""
    left = -1 if window is None else window - 1
    return (left, 0) if causal else (left, -1)


def reads_pages(block_size: int) -> bool:
    return "block_table" in params() and block_size % PAGE_MULTIPLE == 0


def missing(call) -> str | None:
    """What this torch's ``varlen_attn`` lacks for ``call`` (None when it can serve it)."""
    names = params()
    if not names:
        return "is not in this torch (torch.nn.attention.varlen.varlen_attn arrived in torch 2.9)"
    if "scale" not in names:
        return "is too old in this torch (no scale=; torch >= 2.10)"
    if call.softcap:
        return "has no softcap"
    if call.window is not None and "window_size" not in names:
        return "has no window_size in this torch (torch >= 2.10)"
    if call.device.type == "cuda" and torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability(call.device)
        if major < 8:
            return "needs an Ampere or newer GPU"
    return None


def torch_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    causal: bool,
    scale: float,
    window: int | None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """``varlen_attn`` on flat ``k``/``v`` ``(total_k, kv_heads, dim)`` or, with ``block_table``,
    on a paged cache ``(pages, page_size, kv_heads, dim)``. Every tensor handed over is what the
    kernel checks for: int32 and contiguous boundaries on q's device, Python-int maxima."""
    func = varlen_attn()
    names = params()
    if q.dtype not in DTYPES:
        raise ValueError(f"torch varlen_attn runs fp16/bf16 only, got {q.dtype}; choose_backend routes fp32 elsewhere")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"torch varlen_attn takes head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    device = q.device
    k, v = k.to(q.dtype), v.to(q.dtype)
    kv_heads = k.shape[-2]
    if q.shape[1] != kv_heads and "enable_gqa" not in names:  # older torch: one K/V head per query head
        groups = q.shape[1] // kv_heads
        k, v = (t.repeat_interleave(groups, dim=-2) for t in (k, v))
    kwargs = {"scale": float(scale)}
    if "is_causal" in names:
        kwargs["is_causal"] = bool(causal) and window is None
        if window is not None:
            kwargs["window_size"] = window_size(causal, window)
    else:
        kwargs["window_size"] = window_size(causal, window)
    if "enable_gqa" in names:
        kwargs["enable_gqa"] = q.shape[1] != kv_heads
    if block_table is not None:
        if not reads_pages(k.shape[1]):
            raise ValueError(
                f"torch varlen_attn reads paged K/V only in pages of a multiple of "
                f"{PAGE_MULTIPLE} "
                f"tokens (got {k.shape[1]}) and from torch 2.12; gather the K/V first"
            )
        kwargs["block_table"] = block_table.to(device, torch.int32).contiguous()
        kwargs["seqused_k"] = torch.tensor(meta.seqlens_k, dtype=torch.int32).to(device, non_blocking=True)
    return func(
        q,
        k,
        v,
        meta.cu_seqlens_q.to(device, torch.int32).contiguous(),
        meta.cu_seqlens_k.to(device, torch.int32).contiguous(),
        int(meta.max_seqlen_q),
        int(meta.max_seqlen_k),
        **kwargs,
    )


def _forward(q, k, v, meta, opts, table=None, block_size=1):
    if table is not None:  # the dispatcher hands a paged cache flattened to (pages * size, kv_heads, dim)
        k, v = (t.view(-1, block_size, *t.shape[1:]) for t in (k, v))
    return torch_varlen(q, k, v, meta, causal=opts.causal, scale=opts.scale, window=opts.window, block_table=table)


BACKENDS = (
    Backend(
        "torch_varlen",
        _forward,
        devices=("cuda",),
        dtypes=DTYPES,
        missing=missing,
        reads_pages=reads_pages,
        install="PyTorch >= 2.10 with CUDA; paged K/V from 2.12",
    ),
)
