"""Thin dispatch to FlashAttention's varlen kernel (CUDA only): flash-attn 2 (``flash_attn``) or
flash-attn 3 (``flash_attn_interface``, Hopper).

The arguments follow flash-attn's own checks (``csrc/flash_attn/flash_api.cpp``,
``flash_attn/flash_attn_interface.py``): q/k/v fp16 or bf16 and one dtype, ``cu_seqlens_q/k``
int32, contiguous and on q's device, ``max_seqlen_q/k`` Python ints, head dim <= 256, query heads a
multiple of KV heads, ``causal`` aligned to the bottom-right corner, a sliding window as
``window_size=(left, right)`` with ``(-1, -1)`` meaning unlimited, ``softcap=0.0`` meaning off,
and paged K/V as ``(num_blocks, page_block_size, kv_heads, dim)`` plus an int32 ``block_table`` -
which FA2's varlen kernel accepts only when the page size is a multiple of 256.

Installed versions differ in what they accept, so features are read off the installed function's
signature, never assumed: ``softcap`` arrived in 2.6, ``block_table`` in varlen in 2.5, flash-attn
3's varlen function has neither ``dropout_p`` nor ``block_table``. A flash-attn whose CUDA
extension fails to import (wrong torch/CUDA build) is reported once and treated as absent.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nopad.packing._native import installed
from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)

FA2_PAGE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
# (module, version label), in order of preference: FA2 has the paged varlen kernel
_CANDIDATES = (("flash_attn", "2"), ("flash_attn_interface", "3"))


@dataclass(frozen=True)
class FlashAttn:
    """The installed flash-attn and what its ``flash_attn_varlen_func`` accepts."""

    module: str  # "flash_attn" or "flash_attn_interface"
    version: str  # "2" or "3"
    varlen_func: Callable
    params: frozenset  # parameter names of flash_attn_varlen_func

    @property
    def softcap(self) -> bool:
        return "softcap" in self.params

    @property
    def window(self) -> bool:
        return "window_size" in self.params

    @property
    def paged(self) -> bool:
        """True when the varlen kernel reads a paged cache through ``block_table``."""
        return "block_table" in self.params

    def missing(self, *, softcap: float | None, window: int | None) -> str | None:
        """What this layer needs that the installed version lacks (None when it can serve it)."""
        if softcap and not self.softcap:
            return "softcap (attention logit soft-capping, flash-attn >= 2.6)"
        if window is not None and not self.window:
            return "window_size (sliding-window attention, flash-attn >= 2.3)"
        return None

    def __str__(self) -> str:
        return f"flash-attn {self.version} ({self.module})"


@functools.cache
def flash_attn_info() -> FlashAttn | None:
    """The usable flash-attn, or None. Cached: call ``flash_attn_info.cache_clear()`` after
    installing one in a running process (the tests do)."""
    for name, version in _CANDIDATES:
        if not installed(name):
            continue
        try:
            module = importlib.import_module(name)
            func = module.flash_attn_varlen_func
        except (ImportError, OSError, AttributeError) as error:
            warnings.warn(
                f"{name} is installed but does not import ({error}); nopad uses PyTorch attention "
                "instead. Reinstall flash-attn built for this torch and CUDA "
                "(pip install flash-attn --no-build-isolation) to use it.",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        info = FlashAttn(name, version, func, frozenset(inspect.signature(func).parameters))
        logger.info("nopad: found %s; varlen accepts %s", info, sorted(info.params))
        return info
    return None


def window_size(window: int | None) -> tuple[int, int]:
    """Our ``window=W`` (a query sees itself and the W-1 keys before it) in flash-attn's
    ``(left, right)`` form."""
    return (-1, -1) if window is None else (window - 1, 0)


def can_read_pages(info: FlashAttn | None, block_size: int) -> bool:
    """True when the varlen kernel reads a paged cache of ``block_size`` in place (no gather)."""
    return info is not None and info.paged and block_size % FA2_PAGE_MULTIPLE == 0


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    causal: bool,
    scale: float,
    window: int | None,
    softcap: float | None,
    block_table: torch.Tensor | None = None,
    info: FlashAttn | None = None,
) -> torch.Tensor:
    """``flash_attn_varlen_func`` on flat ``k``/``v`` (``(total_k, kv_heads, dim)``) or, with
    ``block_table``, on a paged cache whose page size is a multiple of 256. Every tensor handed
    over is int32/contiguous as flash-attn demands and on q's device."""
    info = info or flash_attn_info()
    if info is None:
        raise RuntimeError("flash-attn is not installed (or does not import); use another backend")
    if q.dtype not in FLASH_DTYPES:
        raise ValueError(f"flash-attn runs fp16/bf16 only, got {q.dtype}; choose_backend routes fp32 to SDPA")
    missing = info.missing(softcap=softcap, window=window)
    if missing is not None:
        raise ValueError(f"the installed {info} has no {missing}; upgrade flash-attn or use backend='sdpa_loop'")
    device = q.device
    k, v = k.to(q.dtype), v.to(q.dtype)
    kwargs = dict(
        cu_seqlens_q=meta.cu_seqlens_q.to(device, torch.int32).contiguous(),
        cu_seqlens_k=meta.cu_seqlens_k.to(device, torch.int32).contiguous(),
        max_seqlen_q=int(meta.max_seqlen_q),
        max_seqlen_k=int(meta.max_seqlen_k),
        softmax_scale=float(scale),
        causal=bool(causal),
    )
    if "dropout_p" in info.params:
        kwargs["dropout_p"] = 0.0
    if info.window:
        kwargs["window_size"] = window_size(window)
    if info.softcap:
        kwargs["softcap"] = 0.0 if softcap is None else float(softcap)
    if block_table is not None:
        if not can_read_pages(info, k.shape[1]):
            raise ValueError(
                f"{info}'s varlen kernel cannot read a paged cache of block size {k.shape[1]} (it needs "
                f"block_table support and a multiple of {FA2_PAGE_MULTIPLE}); gather the K/V first"
            )
        kwargs["block_table"] = block_table.to(device, torch.int32).contiguous()
    out = info.varlen_func(q, k, v, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # flash-attn 3 may return (out, lse)


INSTALL = "pip install flash-attn --no-build-isolation"


def _forward(q, k, v, meta, opts, table=None, block_size=1):
    if table is not None:  # the dispatcher hands a paged cache flattened to (blocks * size, kv_heads, dim)
        k, v = (t.view(-1, block_size, *t.shape[1:]) for t in (k, v))
    return flash_varlen(
        q, k, v, meta, causal=opts.causal, scale=opts.scale, window=opts.window, softcap=opts.softcap, block_table=table
    )


def _missing(call) -> str | None:
    info = flash_attn_info()
    if info is None:
        return "is not installed or does not import"
    missing = info.missing(softcap=call.softcap, window=call.window)
    return None if missing is None else f"is {info}, which has no {missing}; upgrade flash-attn"


BACKENDS = (
    Backend(
        "flash",
        _forward,
        devices=("cuda",),
        dtypes=FLASH_DTYPES,
        missing=_missing,
        install=INSTALL,
        reads_pages=lambda block_size: can_read_pages(flash_attn_info(), block_size),
    ),
)
