"""Varlen attention: one function for a packed training row, a shared-prefix row and a paged
generation step, over whichever backend the forward's :class:`~nopad.packing.attention.plan.AttentionPlan`
picks.

Tensors are flat, shaped ``(total_tokens, heads, head_dim)``; ``meta`` says where each sequence
starts. Keys may be longer than queries (cached context); the causal mask is aligned to the end
of each sequence's keys. This module does what is the same for every backend: check the call,
write new K/V into the cache, hand the backend its keys (in place when it reads pages or a key
index, gathered otherwise) and give forward-only kernels a backward.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from nopad.packing.attention.plan import AttentionPlan
from nopad.packing.attention.registry import Opts
from nopad.packing.attention.sdpa import _sdpa
from nopad.packing.varlen import VarlenMeta


def store_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' K/V ``(T, kv_heads, dim)`` into a paged cache
    ``(num_blocks, block_size, kv_heads, dim)`` at flat slots ``block * block_size + offset``."""
    k_cache, v_cache = kv_cache
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, meta: VarlenMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's keys out of a paged cache into flat ``(total_k, kv_heads, dim)``."""
    k_cache, v_cache = kv_cache
    device, block_size = k_cache.device, k_cache.shape[1]
    seq, pos = (t.to(device) for t in meta.key_positions)  # built once per meta, not per layer
    table = meta.block_table_long if block_table is meta.block_table else block_table.to(torch.long)
    rows = table.to(device)[seq, pos // block_size] * block_size + pos % block_size
    k_flat, v_flat = (c.view(-1, *c.shape[2:]) for c in kv_cache)
    return k_flat.index_select(0, rows), v_flat.index_select(0, rows)


class RecomputeBackward(torch.autograd.Function):
    """A forward-only kernel (the compiled CPU kernel, the Triton kernel) for training rows: its
    forward runs the kernel, its backward recomputes attention with the best differentiable
    backend (any correct backward will do: only the forward must match the generator's). With a
    key ``table`` (a shared-prefix row) the keys are gathered for the backward, whose
    ``index_select`` sums every completion's gradient into the prompt's K/V rows. Attention sinks
    (``opts.sinks``) come in as ``sinks`` too, so they receive their gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, meta: VarlenMeta, opts: Opts, backend, table, differentiable):
        ctx.save_for_backward(q, k, v, sinks)
        ctx.meta, ctx.opts, ctx.table, ctx.differentiable = meta, opts, table, differentiable
        return backend.forward(q, k, v, meta, opts, table=table, block_size=1)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, sinks = ctx.saved_tensors
        meta, opts = ctx.meta, ctx.opts
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            s_ = sinks.detach().requires_grad_(sinks.requires_grad) if sinks is not None else None
            keys = (
                (k_, v_)
                if ctx.table is None
                else (k_.index_select(0, meta.key_rows), v_.index_select(0, meta.key_rows))
            )
            out = ctx.differentiable.forward(q_, *keys, _flat(meta), replace(opts, sinks=s_))
            inputs = [t for t in (q_, k_, v_, s_) if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad_out) if inputs else ())
        return tuple(next(grads) if t is not None and t.requires_grad else None for t in (q, k, v, sinks)) + (None,) * 5


def _flat(meta: VarlenMeta) -> VarlenMeta:
    """The meta a backend sees once a shared-prefix row's keys are gathered: a plain row."""
    return meta if meta.key_index is None else meta.without_key_index


def _check(q, k, v, meta: VarlenMeta, kv_cache, table, sliding_window) -> int:
    """Validate a call; returns the number of KV heads."""
    if q.dim() != 3:
        raise ValueError(f"q must be (total_tokens, heads, head_dim), got shape {tuple(q.shape)}")
    if q.shape[0] != meta.total_q:
        raise ValueError(f"q has {q.shape[0]} tokens but meta describes {meta.total_q}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if kv_cache is not None:
        if table is None:
            raise ValueError("kv_cache needs a block_table (argument or meta.block_table)")
        if table.shape[0] != meta.num_seqs:
            raise ValueError(f"block_table has {table.shape[0]} rows but meta has {meta.num_seqs} sequences")
        k_cache, v_cache = kv_cache
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError(
                "kv_cache must be two tensors shaped (num_blocks, block_size, kv_heads, head_dim), "
                f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        if k is not None and meta.slot_mapping is None:
            raise ValueError("new K/V given with kv_cache but meta.slot_mapping is None")
        if k is not None and (k.shape[1:] != k_cache.shape[2:] or v.shape[1:] != v_cache.shape[2:]):
            raise ValueError(
                f"this layer's K/V are (kv_heads, head_dim) {tuple(k.shape[1:])} / {tuple(v.shape[1:])} "
                "per token "
                f"but its paged cache holds {tuple(k_cache.shape[2:])}: the cache was sized for another "
                "attention layout (nopad.inference.kv_cache.kv_layout reads it from the layer's k_proj / v_proj "
                "and head_dim, else the config; a layer that reshapes its K/V at run time, as JetMoE's "
                "repeats them top_k times, cannot be laid out ahead: generate with HF generate)"
            )
        kv_heads = k_cache.shape[2]
    else:
        if k is None or v is None:
            raise ValueError("k and v are required when no kv_cache is given")
        if meta.key_index is not None:  # a shared-prefix row: keys are rows of this row's own K/V
            if k.shape[0] != meta.total_q or v.shape[0] != meta.total_q:
                raise ValueError(
                    f"k/v have {k.shape[0]}/{v.shape[0]} tokens but this shared-prefix row has "
                    f"{meta.total_q}; pass the row's own keys (one per token)"
                )
        elif k.shape[0] != meta.total_k or v.shape[0] != meta.total_k:
            raise ValueError(
                f"k/v have {k.shape[0]}/{v.shape[0]} tokens but meta describes "
                f"{meta.total_k}: the keys must be the row's own, one per token; a layer that "
                "adds keys of its own (pooled, compressed or memory K/V) cannot run on a packed "
                "row (docs/models.md)"
            )
        kv_heads = k.shape[1]
    if q.shape[1] % kv_heads:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({kv_heads})")
    return kv_heads


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
    backend: str = "auto",
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over a flat varlen row; returns ``(total_q, heads, v_head_dim)``.

    ``k``/``v`` are the keys of this row, or, with ``kv_cache``, the new tokens' keys, which are
    first written to the cache at ``meta.slot_mapping``; keys are then read through
    ``block_table`` (default ``meta.block_table``). For a shared-prefix row
    (:meth:`VarlenMeta.shared_prefix`) ``k``/``v`` hold one key per token of the row and each
    sequence reads its keys through ``meta.key_index``. A static decode step
    (:meth:`VarlenMeta.static_decode`) has its lengths on the device only. ``sliding_window=W``
    lets a query at position ``p`` see keys ``p - W < j <= p``; ``softcap=c`` applies
    ``c * tanh(score / c)``. ``backend`` names one of :func:`nopad.packing.attention.registry.names`.
    ``plan`` is the forward's :class:`AttentionPlan` (every layer of a forward passes the same one;
    without it this call makes its own). ``sinks`` ``(heads,)`` are attention sinks (gpt-oss's
    ``s_aux``): one logit per query head in every softmax denominator, with no value; only backends
    declared to take them run such a layer. Keys and values of different head sizes (MLA) run as
    one head size, the smaller zero-padded (:func:`one_head_dim`), and the output is cut back to
    the values' size.
    """
    plan = plan if plan is not None else AttentionPlan()
    softcap = softcap or None  # 0.0 means off, as in flash-attn and HF configs
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != q.shape[1]):
        raise ValueError(f"sinks must hold one logit per query head ({q.shape[1]}), got shape {tuple(sinks.shape)}")
    opts = Opts(causal=causal, scale=scale, window=sliding_window, softcap=softcap, sinks=sinks)
    value_dim = v.shape[-1] if v is not None else None
    if k is not None and v is not None and not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        q, k, v = one_head_dim(q, k, v)
    out = _attend(q, k, v, meta, kv_cache, block_table, opts, backend, plan)
    return out if value_dim is None or out.shape[-1] == value_dim else out[..., :value_dim]


def one_head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Queries/keys and values of different head sizes (MLA: DeepSeek-V3, Kimi) as one size for
    every backend and the paged cache: the smaller side zero-padded. A zero column adds nothing to
    a score and gives a zero output column (cut off after), so the result is exact."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"queries and keys must share a head size, got {q.shape[-1]} and {k.shape[-1]}")
    width = max(k.shape[-1], v.shape[-1])
    return tuple(t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))


def _attend(
    q, k, v, meta: VarlenMeta, kv_cache, block_table, opts: Opts, backend: str, plan: AttentionPlan
) -> torch.Tensor:
    """:func:`varlen_attention` once the options are spelled and the head sizes are one."""
    softcap, sliding_window, sinks = opts.softcap, opts.window, opts.sinks
    if meta.is_static:
        return _static_decode(q, k, v, meta, kv_cache, opts, backend, plan)
    table = None
    if kv_cache is not None:
        table = block_table if block_table is not None else meta.block_table
    _check(q, k, v, meta, kv_cache, table, sliding_window)
    if kv_cache is not None and k is not None:
        store_kv(kv_cache, k, v, meta.slot_mapping)
    if k is not None and (k.dtype != q.dtype or v.dtype != q.dtype):
        k, v = k.to(q.dtype), v.to(q.dtype)  # one compute dtype, as flash-attn and SDPA require

    shared = meta.key_index is not None and kv_cache is None
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, sinks))
    block_size = kv_cache[0].shape[1] if kv_cache is not None else 1
    call, chosen = plan.decide(
        q.device,
        q.dtype,
        softcap,
        sliding_window,
        paged=kv_cache is not None,
        block_size=block_size,
        shared_prefix=shared,
        grad=grad,
        override=backend,
        sinks=sinks is not None,
    )
    differentiable = None  # what a forward-only kernel's backward recomputes with
    if grad and not chosen.grad:
        differentiable = plan.differentiable(q.device, q.dtype, softcap, sliding_window, sinks is not None)

    if kv_cache is not None:
        if chosen.reads_in_place(call) and kv_cache[0].dtype == q.dtype and not grad:
            flat = [c.view(-1, *c.shape[2:]) for c in kv_cache]  # keys read in place
            return chosen.forward(q, flat[0], flat[1], meta, opts, table=table, block_size=block_size)
        k, v = (t.to(q.dtype) for t in gather_kv(kv_cache, table, meta))
    elif shared and chosen.reads_in_place(call):
        if grad and not chosen.grad:
            return RecomputeBackward.apply(q, k, v, sinks, meta, opts, chosen, meta.key_index, differentiable)
        return chosen.forward(q, k, v, meta, opts, table=meta.key_index, block_size=1)
    elif shared:  # gather each sequence's keys (index_select: the prompt's rows receive the
        # gradients of every completion that reads them)
        k, v = k.index_select(0, meta.key_rows), v.index_select(0, meta.key_rows)
    flat_meta = _flat(meta)
    if grad and not chosen.grad:
        return RecomputeBackward.apply(q, k, v, sinks, flat_meta, opts, chosen, None, differentiable)
    return chosen.forward(q, k, v, flat_meta, opts)


def _static_decode(q, k, v, meta: VarlenMeta, kv_cache, opts: Opts, backend: str, plan: AttentionPlan) -> torch.Tensor:
    """One query per row, keys read through the meta's fixed-width block table and device-side
    context lengths: nothing here is a Python number, so a compiled or CUDA-graph forward does not
    depend on the context lengths. Padding rows point at a scratch block and have length 1."""
    if kv_cache is None:
        raise ValueError("a static decode step needs nopad_kv_cache")
    if q.shape[0] != meta.slot_mapping.shape[0]:
        raise ValueError(
            f"the static decode step describes {meta.slot_mapping.shape[0]} rows but the batch "
            f"has {q.shape[0]} tokens; a static decode step runs one token per row"
        )
    store_kv(kv_cache, k, v, meta.slot_mapping)
    k_cache, v_cache = kv_cache
    chosen = plan.decide(
        q.device,
        k_cache.dtype,
        opts.softcap,
        opts.window,
        paged=True,
        block_size=k_cache.shape[1],
        static=True,
        override=backend,
        sinks=opts.sinks is not None,
    ).backend
    if chosen.static_decode is not None:  # keys read in place, one opaque op
        out = chosen.static_decode(
            q.to(k_cache.dtype).contiguous(),
            k_cache,
            v_cache,
            meta.block_table,
            meta.context_lens,
            opts.scale,
            opts.window or 0,
            opts.softcap or 0.0,
            opts.sinks,
        )
        return out.to(q.dtype)
    rows, width = meta.block_table.shape  # else: gather `width` whole blocks per row, mask the rest
    keys = width * k_cache.shape[1]
    table = meta.block_table.to(torch.long)
    kk = k_cache[table].reshape(rows, keys, *k_cache.shape[2:]).transpose(1, 2)
    vv = v_cache[table].reshape(rows, keys, *v_cache.shape[2:]).transpose(1, 2)
    pos = torch.arange(keys, device=q.device)[None, :]
    lens = meta.context_lens[:, None]
    keep = pos < lens
    if opts.window is not None:
        keep = keep & (pos > lens - 1 - opts.window)
    sinks = None if opts.sinks is None else opts.sinks.view(-1, 1, 1)
    out = _sdpa(
        q[:, :, None].to(kk.dtype), kk, vv, keep[:, None, None, :], scale=opts.scale, softcap=opts.softcap, sinks=sinks
    )
    return out[:, :, 0].to(q.dtype)
