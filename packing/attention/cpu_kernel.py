"""The compiled varlen attention forward (``nopad.packing._varlen_attention``, csrc/varlen_attention.cpp).

One CPU kernel for every shape the core sees: a packed training row, a prefill chunk and a decode
token, keys read in place from a flat row or a paged cache, in fp32, bf16 or fp16. Each query's
result depends only on its own keys (fixed key blocks, fixed order), which is what makes the
generator's log-probs equal the trainer's in :func:`nopad.packing.batch_invariant`. For training the
forward runs here and the backward recomputes attention with PyTorch's SDPA (any correct backward
will do: only the forward must match the generator's).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from nopad.packing._native import load_extension
from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 256


def kernel() -> ModuleType | None:
    """The compiled kernel, or None (warned once) when it was not built."""
    return load_extension("nopad.packing._varlen_attention", "varlen attention kernel", "PyTorch attention")


def _host_arrays(meta: VarlenMeta, table: torch.Tensor | None):
    """The kernel's int arrays for this row: the meta's host boundaries (built once per meta, so
    every layer of a forward shares them) and its block table or key index on the host."""
    cu_q, lens_k, starts = meta.host_boundaries
    if table is None:
        return cu_q, lens_k, starts, None
    if table is meta.block_table:
        return cu_q, lens_k, None, meta.host_block_table
    if table is meta.key_index:
        return cu_q, lens_k, None, meta.host_key_index
    return cu_q, lens_k, None, np.ascontiguousarray(table.detach().cpu().numpy(), dtype=np.int32)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: VarlenMeta,
    *,
    table: torch.Tensor | None = None,
    block_size: int = 1,
    causal: bool = True,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention output ``(total_q, heads, dim)`` in q's dtype. ``k``/``v`` are flat
    ``(total_k, kv_heads, dim)`` keys, or with ``table`` a paged cache flattened to
    ``(blocks * block_size, kv_heads, dim)``. ``sinks`` ``(heads,)``: attention sinks, added to
    each row's softmax denominator at the end (``exp(sink - max)``: exact, and one fixed order for
    every call, so the batch-invariant mode holds with them). No autograd: the dispatcher gives
    training rows a backward (:class:`nopad.packing.attention.dispatch.RecomputeBackward`)."""
    if q.dtype not in DTYPE_CODES:
        raise ValueError(
            f"the attention kernel takes fp32, bf16 or fp16 tensors, got {q.dtype}; cast q/k/v "
            "to the model's compute dtype"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the attention kernel takes head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype) or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q, k, v must share dtype and head dim: {q.dtype} {tuple(q.shape)}, "
            f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}"
        )
    q = q.detach().contiguous()
    k, v = k.detach().contiguous(), v.detach().contiguous()
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    cu_q, lens_k, starts, tab = _host_arrays(meta, table)
    kernel().forward(
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        out.data_ptr(),
        DTYPE_CODES[q.dtype],
        k.shape[0],
        cu_q,
        lens_k,
        starts,
        tab,
        int(block_size),
        q.shape[1],
        k.shape[1],
        q.shape[2],
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        bool(causal),
        torch.get_num_threads(),
        **_sink_argument(sinks),
    )
    return out


def _sink_argument(sinks: torch.Tensor | None) -> dict:
    """The kernel's ``sinks=`` keyword (fp32 on the host, one per query head); none without sinks,
    so a kernel built before sinks still runs every other layer."""
    if sinks is None:
        return {}
    return {"sinks": np.ascontiguousarray(sinks.detach().to(device="cpu", dtype=torch.float32).numpy())}


@torch.compiler.assume_constant_result
def takes_sinks() -> bool:
    """The built kernel takes attention sinks (an extension built before them does not: rebuild)."""
    return built() and "sinks" in (kernel().forward.__doc__ or "")


# ---- the static decode step as a custom op, so torch.compile sees one opaque call.
# Why: a compiled decode step (``Generator(compile_decode=True)``) fuses the model's small ops
# (RMSNorm, RoPE, SiLU, residual adds) around attention, but the kernel is called through raw data
# pointers and host arrays, which dynamo cannot trace: every layer would break the graph. As a
# custom op it takes only tensors with static-shape-friendly arguments (the static decode step's
# block table and context lengths) and has a fake implementation, so the whole decode forward
# compiles to one graph, with dynamic batch and table width.


@torch.compiler.assume_constant_result
def built() -> bool:
    """The kernel was built (decided once: dynamo cannot trace the extension's import)."""
    global _KERNEL
    _KERNEL = kernel()
    return _KERNEL is not None


def _paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row ``q (rows, heads, dim)`` over that row's keys in a paged cache
    ``(blocks, block_size, kv_heads, dim)``: ``context_lens[i]`` keys through ``block_table[i]``.
    Same kernel, same per-query order as every other CPU generation step. Calls no other Python
    function (sinks inline, the extension held in ``_KERNEL``): a compiled decode step runs it once
    per layer, so each call here is one more host call per layer of every step."""
    rows = q.shape[0]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    block_size = k_cache.shape[1]
    extra = (
        {}
        if sinks is None
        else {"sinks": np.ascontiguousarray(sinks.detach().to(device="cpu", dtype=torch.float32).numpy())}
    )
    (_KERNEL or kernel()).forward(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        DTYPE_CODES[q.dtype],
        k_cache.shape[0] * block_size,
        np.arange(rows + 1, dtype=np.int32),
        np.ascontiguousarray(context_lens.numpy(), dtype=np.int32),
        None,
        np.ascontiguousarray(block_table.numpy(), dtype=np.int32),
        block_size,
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        scale,
        softcap,
        window,
        True,
        torch.get_num_threads(),
        **extra,
    )
    return out


# Defined with torch.library.Library, not torch.library.custom_op: a compiled step calls the op once
# per layer, and custom_op's Python wrappers (autograd, backend and aliasing checks: 13 calls) made
# the compiled decode step's Python grow by 17 calls a layer; this way the dispatcher, in C++, calls
# _paged_decode directly (2 calls a layer with OpOverload.__call__). No autograd: decode runs without.
_LIB = torch.library.Library("nopad", "FRAGMENT")
_LIB.define(
    "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor context_lens, "
    "float scale, int window, float softcap, Tensor? sinks=None) -> Tensor"
)
_LIB.impl("paged_decode", _paged_decode, "CPU")
paged_decode = torch.ops.nopad.paged_decode.default
_KERNEL: ModuleType | None = None  # the extension, once built() has loaded it


@torch.library.register_fake("nopad::paged_decode", lib=_LIB)
def _(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap, sinks=None):
    return torch.empty_like(q)


def _forward(q, k, v, meta, opts, table=None, block_size=1):
    return forward(
        q,
        k,
        v,
        meta,
        table=table,
        block_size=block_size,
        causal=opts.causal,
        scale=opts.scale,
        window=opts.window,
        softcap=opts.softcap,
        sinks=opts.sinks,
    )


def _static_decode(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap, sinks=None):
    """The op for torch.compile; the plain function when nothing traces (an eager static step): a
    custom op's dispatch costs the host tens of microseconds per layer."""
    op = paged_decode if torch.compiler.is_compiling() else _paged_decode
    return op(q, k_cache, v_cache, block_table, context_lens, scale, window or 0, softcap or 0.0, sinks)


def _missing(call) -> str | None:
    if not built():
        return "is not built (the C++ extension did not compile; reinstall nopad with a compiler)"
    if call.sinks and not takes_sinks():
        return "was built before it took attention sinks (rebuild it: pip install -e .)"
    return None


BACKENDS = (
    Backend(
        "kernel",
        _forward,
        devices=("cpu",),
        dtypes=tuple(DTYPE_CODES),
        grad=False,
        invariant=True,
        reads_pages=lambda block_size: True,
        static_decode=_static_decode,
        missing=_missing,
        sinks=True,
    ),
)
