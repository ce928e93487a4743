"""The Triton varlen attention forward: the CUDA twin of the compiled CPU kernel (cpu_kernel.py).

One kernel for every shape the core sees: a packed training row (flat keys through
``cu_seqlens_k``), a prefill chunk and a decode token reading a paged cache in place through its
block table, with GQA, a sliding window, softcap, causal or not, fp32/bf16/fp16, any block size
>= 16 and head dims up to 256 (padded to a power of two, masked).

Why one kernel with one order: :func:`nopad.packing.batch_invariant` promises that a token's log-probs do
not depend on what else shares the step. So each query visits its keys in blocks of ``BLOCK_N``
aligned to absolute key 0, in increasing order, with one tile configuration per (head dim, dtype)
(:func:`tile_config`) whatever the call: the number of sequences, their lengths, the chunking, flat
or paged keys. A program owns ``BLOCK_M`` (query token, head of the KV group) rows of one sequence
and one KV head; each row's arithmetic involves only its own query and keys, and a key block that
is fully masked for a row leaves that row's state untouched (selected, not added to), so whether
neighbours make a program visit more blocks never changes a row's bits.

On the GPU fp16/bf16 dots run natively on tensor cores (an MMA sums each output element in the
same order whatever its row) and fp32 dots in IEEE fp32 (no TF32). Under Triton's interpreter (CPU
tensors, ``TRITON_INTERPRET=1``, how the tests run it) ``tl.dot`` is numpy's BLAS matmul, whose sums
depend on a row's place in the tile (and which is wrong for bf16), so there the two products are
an fp32 multiply and ``tl.sum`` over the reduced axis instead (``triton_jit._dot``): operands rounded to
the compute dtype as on the GPU, exact products, one summation order for every row. Softmax
statistics are fp32 everywhere.

Forward only: training rows recompute the backward through the dispatcher's differentiable
backend (:class:`nopad.packing.attention.dispatch.RecomputeBackward`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta

try:
    import triton
except ImportError:  # optional: the backend then says what to install
    triton = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256
MIN_BLOCK_SIZE = 16  # paged caches with smaller blocks are gathered (a 16-key page keeps loads coalesced)


class Tile(NamedTuple):
    block_m: int  # (query token, head) rows per program
    block_n: int  # keys per block: the unit of each query's key order
    warps: int
    stages: int  # software pipelining depth (memory only: no effect on the arithmetic)


def tile_config(head_dim: int, dtype: torch.dtype) -> Tile:
    """The one tile configuration for a head dim and dtype, used by every call: ``block_n`` is the
    unit of each query's key order, and one configuration keeps the GPU's dot instructions fixed.
    fp32 tiles are smaller at head dims >= 128 so that they fit in 100 KB of shared memory (consumer
    Ampere; figures from compiling for sm_80 with Triton 3.9). Not tuned on a GPU yet."""
    padded = _padded(head_dim)
    if dtype == torch.float32 and padded >= 128:
        return Tile(32, 32, 4, 1 if padded == 256 else 2)
    return Tile(64, 32, 4 if padded <= 64 else 8, 2)


def _padded(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


if triton is not None:
    from nopad.packing.attention.triton_jit import _attention_kernel


def interpreted() -> bool:
    """True when the kernel was built by Triton's interpreter (``TRITON_INTERPRET=1`` was set before
    this module was imported): it then runs on CPU tensors, slowly, for the tests."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_attention_kernel, InterpretedFunction)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the Triton attention kernel needs triton: triton is not installed (pip install triton)")
    if q.dtype not in DTYPES:
        raise ValueError(
            f"the Triton attention kernel takes fp32, bf16 or fp16 tensors, got {q.dtype}; cast "
            "q/k/v to the model's compute dtype"
        )
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernel takes head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype) or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q, k, v must share dtype and head dim: {q.dtype} {tuple(q.shape)}, "
            f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    if q.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the Triton attention kernel runs CPU tensors only under Triton's interpreter: "
            "set TRITON_INTERPRET=1 before nopad is imported, or use a CUDA device"
        )


def _inner_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(
    q,
    k,
    v,
    out,
    cu_q,
    keys,
    table,
    page: int,
    rows: int,
    max_q: int,
    *,
    decode: bool,
    causal: bool,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    groups = heads // kv_heads
    tile = tile_config(dim, q.dtype)
    grid = (rows, triton.cdiv(max_q * groups, tile.block_m), kv_heads)
    paged = table is not None
    if sinks is not None:
        sinks = sinks.detach().to(q.device, torch.float32).contiguous()
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        cu_q,
        keys,
        table if paged else keys,
        sinks if sinks is not None else keys,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        table.stride(0) if paged else 0,
        float(scale),
        float(softcap or 0.0),
        int(window or 0),
        G=groups,
        HEAD_DIM=dim,
        D_PAD=_padded(dim),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        PAGE=int(page),
        PAGED=paged,
        DECODE=decode,
        CAUSAL=bool(causal),
        SOFTCAP=bool(softcap),
        INTERPRETED=q.device.type == "cpu",
        FP32=q.dtype == torch.float32,
        SINKS=sinks is not None,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return out


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
    ``(blocks * block_size, kv_heads, dim)``. ``sinks`` ``(heads,)``: attention sinks, added to each
    row's denominator at the end. No autograd (the dispatcher recomputes the backward)."""
    _check(q, k, v)
    if table is not None and block_size < MIN_BLOCK_SIZE:
        raise ValueError(
            f"the Triton attention kernel reads paged K/V in blocks of >= {MIN_BLOCK_SIZE} "
            f"tokens, got {block_size}; gather the keys first"
        )
    q, k, v = (_inner_contiguous(t.detach()) for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or meta.num_seqs == 0:
        return out
    device = q.device
    cu_q = meta.cu_seqlens_q.to(device, torch.int32)
    cu_k = meta.cu_seqlens_k.to(device, torch.int32)
    if table is not None:
        table = table.to(device, torch.int32).contiguous()
    return _launch(
        q,
        k,
        v,
        out,
        cu_q,
        cu_k,
        table,
        block_size,
        meta.num_seqs,
        meta.max_seqlen_q,
        decode=False,
        causal=causal,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )


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
    ``(blocks, block_size, kv_heads, dim)``: ``context_lens[i]`` keys through ``block_table[i]``
    (int32 or int64, read as they are). Lengths stay on the device and the grid depends only on
    the shapes, so a CUDA graph captures it; the same kernel and per-query order as every other
    call."""
    k = k_cache.view(-1, *k_cache.shape[2:])
    v = v_cache.view(-1, *v_cache.shape[2:])
    _check(q, k, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    return _launch(
        _inner_contiguous(q),
        k,
        v,
        out,
        context_lens,
        context_lens,
        block_table.contiguous(),
        k_cache.shape[1],
        q.shape[0],
        1,
        decode=True,
        causal=True,
        scale=scale,
        window=window or None,
        softcap=softcap or None,
        sinks=sinks,
    )


# The static decode step as a custom op, so torch.compile (``Generator(compile_decode=True)``) sees
# one opaque call per layer rather than tracing the launcher, as the CPU kernel's op does.
paged_decode = torch.library.custom_op("nopad::triton_paged_decode", mutates_args=())(_paged_decode)


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap, sinks=None):
    return torch.empty_like(q)


def _static_decode(*args):
    """The op for torch.compile; the plain function when nothing traces (an eager static step): a
    custom op's dispatch costs the host tens of microseconds per layer."""
    return (paged_decode if torch.compiler.is_compiling() else _paged_decode)(*args)


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


def _missing(call) -> str | None:
    if triton is None:
        return "is not usable: triton is not installed (pip install triton)"
    if call.device.type == "cpu" and not interpreted():
        return "runs CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 before nopad is imported)"
    return None


BACKENDS = (
    Backend(
        "triton",
        _forward,
        devices=("cuda",),
        dtypes=DTYPES,
        grad=False,
        invariant=True,
        reads_pages=lambda block_size: block_size >= MIN_BLOCK_SIZE,
        static_decode=_static_decode,
        missing=_missing,
        sinks=True,
    ),
)
