"""Varlen attention: one function for a packed training row and a paged generation step.

Tensors are flat, shaped ``(total_tokens, heads, head_dim)``; ``meta`` says where each sequence
starts. Keys may be longer than queries (cached context); the causal mask is aligned to the end
of each sequence's keys.

Backends (``backend=``): ``"flash"`` (flash-attn 2 or 3, CUDA), ``"sdpa_loop"`` (one SDPA call per
sequence), ``"sdpa_padded"`` (one padded SDPA call for all sequences), ``"sdpa_dense"`` (one SDPA
with a block-diagonal mask), ``"flex"`` (FlexAttention with a document mask; forward only on
CPU), and ``"auto"``. Which one runs is decided in one place, :func:`choose_backend`: flash-attn
for fp16/bf16 on CUDA when installed, otherwise per-sequence SDPA (the fastest exact CPU path
measured in ``benchmarks/bench_attention.py``); ``NOPAD_ATTN_BACKEND`` overrides ``"auto"``.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass

import torch

from packing import attention_cpu, invariance, kernel_attention
from packing.attention_cpu import KeySource
from packing.flash import FLASH_DTYPES, can_read_pages, flash_attn_info, flash_varlen
from packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "flash", "kernel", "sdpa_loop", "sdpa_padded", "sdpa_dense", "flex", "per_token")
BACKEND_ENV = "NOPAD_ATTN_BACKEND"  # overrides backend="auto" everywhere (training and generator)
_SAID: set = set()  # choices and warnings already logged (each is said once per process)


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


@dataclass
class DecodeBatch:
    """A decode step with static shapes (one query per row, a block table of fixed width), all
    on the device: nothing here is a Python number, so a compiled or CUDA-graph forward does not
    depend on the context lengths. Padding rows point at a scratch block and have length 1."""

    block_table: torch.Tensor  # int64 (rows, width)
    context_lens: torch.Tensor  # int64 (rows,): keys of each row, the new token included
    slot_mapping: torch.Tensor  # int64 (rows,): cache slot of each row's new K/V


def paged_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    decode: DecodeBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``(rows, heads, dim)`` (one token per row) over each row's paged keys,
    with shapes fixed by ``decode.block_table`` alone: store the new K/V, then on CPU run the
    kernel as one custom op (reading the blocks in place), elsewhere gather ``width`` whole blocks
    per row and mask keys past ``context_lens``. Returns ``(rows, heads, dim)``."""
    store_kv(kv_cache, k, v, decode.slot_mapping)
    k_cache, v_cache = kv_cache
    from packing import kernel_ops

    if kernel_ops.serves(q.device, k_cache.dtype):  # keys read in place, one opaque op
        out = kernel_ops.paged_decode(q.to(k_cache.dtype).contiguous(), k_cache, v_cache, decode.block_table,
                                      decode.context_lens, scale, sliding_window or 0, softcap or 0.0)
        return out.to(q.dtype)
    rows, width = decode.block_table.shape
    keys = width * k_cache.shape[1]
    kk = k_cache[decode.block_table].reshape(rows, keys, *k_cache.shape[2:]).transpose(1, 2)
    vv = v_cache[decode.block_table].reshape(rows, keys, *v_cache.shape[2:]).transpose(1, 2)
    pos = torch.arange(keys, device=q.device)[None, :]
    lens = decode.context_lens[:, None]
    keep = pos < lens
    if sliding_window is not None:
        keep = keep & (pos > lens - 1 - sliding_window)
    out = attention_cpu._sdpa(q[:, :, None].to(kk.dtype), kk, vv, keep[:, None, None, :],
                              scale=scale, softcap=softcap)
    return out[:, :, 0].to(q.dtype)


def gather_kv(
    kv_cache: tuple[torch.Tensor, torch.Tensor], block_table: torch.Tensor, meta: VarlenMeta
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather each sequence's keys out of a paged cache into flat ``(total_k, kv_heads, dim)``."""
    k_cache, v_cache = kv_cache
    device = k_cache.device
    seq, pos = (t.to(device) for t in meta.key_positions())  # built once per step, not per layer
    table = meta.block_table_long() if block_table is meta.block_table else block_table.to(torch.long)
    src = KeySource(k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:]), meta,
                    table.to(device), k_cache.shape[1])
    rows = src.rows(pos, seq)
    return src.k.index_select(0, rows), src.v.index_select(0, rows)


def _say_once(key, message: str, *args, warn: bool = False) -> None:
    if key in _SAID:
        return
    _SAID.add(key)
    if warn:
        warnings.warn(message % args, RuntimeWarning, stacklevel=3)
    else:
        logger.info(message, *args)


def choose_backend(
    device: torch.device,
    dtype: torch.dtype,
    *,
    override: str | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    paged: bool = False,
) -> str:
    """The one rule for which attention path runs, given the query's device and compute dtype,
    what is installed, what the layer needs, and an override (``override=`` / ``backend=``, else
    the ``NOPAD_ATTN_BACKEND`` environment variable). Logged once per distinct decision.

    - ``"auto"``: flash-attn only for fp16/bf16 on CUDA when it is installed, imports and has
      what the layer needs (softcap, window); fp32 on CUDA gets per-sequence SDPA (exact) with a
      one-time warning saying how to get flash; everything else per-sequence SDPA. Measured on
      CPU (benchmarks/bench_attention.py, torch 2.13, 1 thread): per-sequence SDPA beats one
      padded call both for training rows (documents of 8-1,024 tokens: the padded call does up to
      4x the work) and for decode steps (64 sequences x ~300 cached tokens: 14 ms vs 41 ms), and
      beats a dense block-diagonal mask and compiled FlexAttention (forward only on CPU) by
      3-30x (8,192 tokens: 134 ms forward, 429 ms forward+backward).
    - ``"auto"`` off CUDA for a generation step (``paged``, K/V in blocks) or inside
      :func:`packing.batch_invariant`: the compiled kernel (``"kernel"``, fp32/bf16/fp16, keys read
      in place, a fixed per-query order); without the compiled kernel, per-sequence SDPA, or in
      batch-invariant mode ``"per_token"`` (its exact pure-PyTorch twin, slow).
    - ``"flash"`` forced: flash-attn on any device (for debugging, and for the tests' CPU
      stand-in). fp32 still goes to SDPA (flash-attn rejects it); a missing flash-attn or a
      feature the installed version lacks is an error instead of a fallback.
    - any other name: that backend.
    """
    requested = override if override not in (None, "auto") else (os.environ.get(BACKEND_ENV) or "auto")
    if requested not in BACKENDS:
        source = "backend=" if override not in (None, "auto") else f"{BACKEND_ENV}="
        raise ValueError(f"unknown attention backend {source}{requested!r}; choose one of {BACKENDS}")
    if requested not in ("auto", "flash"):
        choice = requested
    elif requested == "auto" and torch.device(device).type != "cuda":
        invariant = invariance.is_enabled()
        choice = "sdpa_loop"
        if (invariant or paged) and kernel_attention.usable(device, dtype):
            choice = "kernel"
        elif invariant:
            choice = "per_token"
    else:
        choice = _flash_or_sdpa(requested, dtype, softcap, sliding_window)
    _say_once(("choice", str(device), dtype, requested, choice),
              "nopad attention on %s %s: %s (requested %s)", device, dtype, choice, requested)
    return choice


def _flash_or_sdpa(requested: str, dtype: torch.dtype, softcap, sliding_window) -> str:
    """flash-attn if it can serve this call, else SDPA (auto) or an error (forced)."""
    info = flash_attn_info()
    if info is None:
        if requested == "flash":
            raise RuntimeError(f"attention backend 'flash' was requested ({BACKEND_ENV} or backend=) but "
                               "flash-attn is not installed or does not import; pip install flash-attn")
        _say_once("no-flash", "nopad: flash-attn is not installed; CUDA attention runs per-sequence SDPA "
                  "(pip install flash-attn for the varlen kernel)")
        return "sdpa_loop"
    if dtype not in FLASH_DTYPES:
        _say_once(("fp32", dtype),
                  "nopad: flash-attn runs fp16/bf16 only, so %s attention runs per-sequence SDPA (exact, "
                  "slower). To use flash-attn, train under torch.autocast('cuda', dtype=torch.bfloat16) "
                  "(Accelerate mixed_precision='bf16') or load the model with dtype=torch.bfloat16.",
                  dtype, warn=True)
        return "sdpa_loop"
    missing = info.missing(softcap=softcap, sliding_window=sliding_window)
    if missing is not None:
        if requested == "flash":
            raise ValueError(f"attention backend 'flash' was requested but the installed {info} has no "
                             f"{missing}, which this layer needs; upgrade flash-attn or use "
                             "backend='sdpa_loop'")
        _say_once(("missing", missing),
                  "nopad: the installed %s has no %s; those layers run per-sequence SDPA. Upgrade "
                  "flash-attn (pip install -U flash-attn) to run them on flash-attn.", info, missing,
                  warn=True)
        return "sdpa_loop"
    return "flash"


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
) -> torch.Tensor:
    """Attention over a flat varlen row; returns ``(total_q, heads, head_dim)``.

    ``k``/``v`` are the keys of this row, or, with ``kv_cache``, the new tokens' keys, which are
    first written to the cache at ``meta.slot_mapping``; keys are then read through
    ``block_table`` (default ``meta.block_table``). For a shared-prefix row
    (:meth:`VarlenMeta.shared_prefix`) ``k``/``v`` hold one key per token of the row and each
    sequence reads its keys through ``meta.key_index``. ``sliding_window=W`` lets a query at position
    ``p`` see keys ``p - W < j <= p``; ``softcap=c`` applies ``c * tanh(score / c)``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if q.dim() != 3:
        raise ValueError(f"q must be (total_tokens, heads, head_dim), got shape {tuple(q.shape)}")
    if q.shape[0] != meta.total_q:
        raise ValueError(f"q has {q.shape[0]} tokens but meta describes {meta.total_q}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    softcap = softcap or None  # 0.0 means off, as in flash-attn and HF configs
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    opts = dict(causal=causal, scale=scale, window=sliding_window, softcap=softcap)

    table = None
    if kv_cache is not None:
        table = block_table if block_table is not None else meta.block_table
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
        if k is not None:
            if meta.slot_mapping is None:
                raise ValueError("new K/V given with kv_cache but meta.slot_mapping is None")
            store_kv(kv_cache, k, v, meta.slot_mapping)
        kv_heads = k_cache.shape[2]
    else:
        if k is None or v is None:
            raise ValueError("k and v are required when no kv_cache is given")
        if meta.key_index is not None:  # a shared-prefix row: keys are rows of this row's own K/V
            if k.shape[0] != meta.total_q or v.shape[0] != meta.total_q:
                raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} tokens but this shared-prefix row has "
                                 f"{meta.total_q}; pass the row's own keys (one per token)")
        elif k.shape[0] != meta.total_k or v.shape[0] != meta.total_k:
            raise ValueError(f"k/v have {k.shape[0]}/{v.shape[0]} tokens but meta describes {meta.total_k}")
        kv_heads = k.shape[1]
    if q.shape[1] % kv_heads:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({kv_heads})")

    # a shared-prefix row takes the ordinary training choice: on CPU per-sequence SDPA on gathered
    # keys, faster forward+backward than the kernel reading them in place, whose backward recomputes
    # with SDPA anyway (benchmarks/bench_attention.py: kernel forward 1.79x, forward+backward 0.83x
    # per-sequence SDPA); the kernel in batch-invariant mode
    shared = meta.key_index is not None and kv_cache is None
    backend = choose_backend(q.device, q.dtype, override=backend, softcap=softcap,
                             sliding_window=sliding_window, paged=kv_cache is not None)
    if invariance.is_enabled() and backend not in ("kernel", "per_token"):
        raise ValueError(
            f"batch_invariant() needs an attention path with a fixed per-query order, but backend "
            f"{backend!r} was chosen (device {q.device.type}, dtype {q.dtype}). nopad has one for CPU "
            "tensors (the compiled kernel, or backend='per_token'); run the mode on CPU or leave it off."
        )
    if k is not None and (k.dtype != q.dtype or v.dtype != q.dtype):
        k, v = k.to(q.dtype), v.to(q.dtype)  # one compute dtype, as flash-attn and SDPA require
    if shared and backend == "kernel":  # keys read in place; the backward gathers them
        kopts = dict(causal=causal, scale=scale, window=sliding_window, softcap=softcap,
                     table=meta.key_index, block_size=1)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return kernel_attention.KernelAttention.apply(q, k, v, meta, kopts)
        return kernel_attention.forward(q, k, v, meta, **kopts)
    if shared:  # every other backend: gather each sequence's keys (index_select: the prompt's
        # rows receive the gradients of every completion that reads them)
        k, v = k.index_select(0, meta.key_rows), v.index_select(0, meta.key_rows)
    if backend == "flash":
        flash = dict(causal=causal, scale=scale, sliding_window=sliding_window, softcap=softcap)
        if kv_cache is None:
            return flash_varlen(q, k, v, meta, **flash)
        block_size = kv_cache[0].shape[1]
        if can_read_pages(flash_attn_info(), block_size) and kv_cache[0].dtype == q.dtype:
            return flash_varlen(q, *kv_cache, meta, **flash, block_table=table)
        _say_once(("gather", block_size), "nopad: flash-attn cannot read KV blocks of %d tokens in place; "
                  "every layer gathers the context first (use Generator(block_size=256) with flash-attn 2)",
                  block_size)
        k, v = gather_kv(kv_cache, table, meta)
        return flash_varlen(q, k, v, meta, **flash)
    if kv_cache is not None and kv_cache[0].dtype != q.dtype:  # a cache kept in another dtype
        k, v = (t.to(q.dtype) for t in gather_kv(kv_cache, table, meta))
        kv_cache = None
    if backend == "kernel":
        kopts = dict(causal=causal, scale=scale, window=sliding_window, softcap=softcap)
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v))
        if kv_cache is not None and not grad:  # a generation step: keys read in place
            flat = [c.view(-1, *c.shape[2:]) for c in kv_cache]
            return kernel_attention.forward(q, flat[0], flat[1], meta, table=table,
                                            block_size=kv_cache[0].shape[1], **kopts)
        if kv_cache is not None:
            k, v = gather_kv(kv_cache, table, meta)
        if grad:
            return kernel_attention.KernelAttention.apply(q, k, v, meta, kopts)
        return kernel_attention.forward(q, k, v, meta, **kopts)
    if backend in ("sdpa_dense", "flex"):
        if kv_cache is not None:
            k, v = gather_kv(kv_cache, table, meta)
        if backend == "sdpa_dense":
            return attention_cpu.dense(q, k, v, meta, **opts)
        return _flex(q, k, v, meta, **opts)

    if kv_cache is not None:
        flat = [c.view(-1, *c.shape[2:]) for c in kv_cache]
        src = KeySource(flat[0], flat[1], meta, table, kv_cache[0].shape[1], new_k=k, new_v=v)
    else:
        src = KeySource(k, v, meta)
    if backend == "sdpa_padded":
        return attention_cpu.padded(q, src, **opts)
    if backend == "per_token":
        return _cat(attention_cpu.per_token(q, src, **opts), q)
    return _cat(attention_cpu.per_sequence(q, src, **opts), q)  # "sdpa_loop"


def _cat(pieces: list, q: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return q.new_zeros(q.shape)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _flex(q, k, v, meta: VarlenMeta, *, causal, scale, window, softcap) -> torch.Tensor:
    """FlexAttention with a document mask. CPU FlexAttention has no backward (torch 2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("FlexAttention has no backward on CPU; use backend='auto' or 'sdpa_loop' to train")
    if not torch.is_grad_enabled():  # CPU flex refuses inputs that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    device = q.device
    seq_k, k_pos = (t.to(device) for t in meta.key_positions())
    seq_q = meta.seq_idx_long().to(device)
    q_pos = meta.position_ids.to(device)  # the query's position among its sequence's keys

    def mask_mod(b, h, qi, ki):
        keep = seq_q[qi] == seq_k[ki]
        if causal:
            keep = keep & (k_pos[ki] <= q_pos[qi])
        if window is not None:
            keep = keep & (k_pos[ki] > q_pos[qi] - window)
        return keep

    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=device)
    out = flex_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
