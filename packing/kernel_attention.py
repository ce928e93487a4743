"""The compiled varlen attention forward (``packing._varlen_attention``, csrc/varlen_attention.cpp).

One CPU kernel for every shape the core sees: a packed training row, a prefill chunk and a decode
token, keys read in place from a flat row or a paged cache, in fp32, bf16 or fp16. Each query's
result depends only on its own keys (fixed key blocks, fixed order), which is what makes the
generator's log-probs equal the trainer's in :func:`packing.batch_invariant`. For training the
forward runs here and the backward recomputes attention with PyTorch's SDPA (any correct backward
will do: only the forward must match the generator's).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from packing._native import load_extension
from packing.varlen import VarlenMeta

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 256


def kernel() -> ModuleType | None:
    """The compiled kernel, or None (warned once) when it was not built."""
    return load_extension("packing._varlen_attention", "varlen attention kernel", "PyTorch attention")


def usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """True when the kernel can serve attention on ``device`` in ``dtype`` (it was built, CPU,
    fp32/bf16/fp16). Head dims above MAX_HEAD_DIM are refused by :func:`forward`."""
    return torch.device(device).type == "cpu" and dtype in DTYPE_CODES and kernel() is not None


def _host_arrays(meta: VarlenMeta, table: torch.Tensor | None):
    """The kernel's int arrays for this row, built once per meta (every layer of a forward shares
    them) in the meta's own cache when ``table`` is the meta's block table or key index."""
    name = ("kernel_host_flat" if table is None else "kernel_host_blocks" if table is meta.block_table
            else "kernel_host_keys" if table is meta.key_index else None)
    if name in meta._derived:
        return meta._derived[name]
    cu_q = np.concatenate(([0], np.cumsum(meta.seqlens_q))).astype(np.int32)
    lens_k = np.asarray(meta.seqlens_k, dtype=np.int32)
    if table is None:
        starts = np.concatenate(([0], np.cumsum(meta.seqlens_k)[:-1])).astype(np.int64)
        arrays = (cu_q, lens_k, starts, None)
    else:
        arrays = (cu_q, lens_k, None, np.ascontiguousarray(table.detach().cpu().numpy(), dtype=np.int32))
    if name is not None:
        meta._derived[name] = arrays
    return arrays


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
) -> torch.Tensor:
    """Attention output ``(total_q, heads, dim)`` in q's dtype. ``k``/``v`` are flat
    ``(total_k, kv_heads, dim)`` keys, or with ``table`` a paged cache flattened to
    ``(blocks * block_size, kv_heads, dim)``. No autograd (see :class:`KernelAttention`)."""
    if q.dtype not in DTYPE_CODES:
        raise ValueError(f"the attention kernel takes fp32, bf16 or fp16 tensors, got {q.dtype}; cast q/k/v "
                         "to the model's compute dtype")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"the attention kernel takes head_dim <= {MAX_HEAD_DIM}, got {q.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype) or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"q, k, v must share dtype and head dim: {q.dtype} {tuple(q.shape)}, "
                         f"{k.dtype} {tuple(k.shape)}, {v.dtype} {tuple(v.shape)}")
    q = q.detach().contiguous()
    k, v = k.detach().contiguous(), v.detach().contiguous()
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    cu_q, lens_k, starts, tab = _host_arrays(meta, table)
    kernel().forward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), DTYPE_CODES[q.dtype], k.shape[0],
        cu_q, lens_k, starts, tab, int(block_size), q.shape[1], k.shape[1], q.shape[2],
        float(scale), float(softcap or 0.0), int(window or 0), bool(causal), torch.get_num_threads(),
    )
    return out


class KernelAttention(torch.autograd.Function):
    """Training rows: forward by the kernel, backward by PyTorch's per-sequence SDPA. With
    ``opts["table"]`` (a shared-prefix row, ``meta.key_rows``) the keys are read in place in the
    forward and gathered in the backward, whose ``index_select`` sums every completion's gradient
    into the prompt's K/V rows."""

    @staticmethod
    def forward(ctx, q, k, v, meta: VarlenMeta, opts: dict):
        ctx.save_for_backward(q, k, v)
        ctx.meta, ctx.opts = meta, opts
        return forward(q, k, v, meta, **opts)

    @staticmethod
    def backward(ctx, grad_out):
        from packing import attention_cpu
        from packing.attention_cpu import KeySource

        q, k, v = ctx.saved_tensors
        opts, meta = ctx.opts, ctx.meta
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
            keys = k_, v_
            if opts.get("table") is not None:  # a shared-prefix row: gather the keys it read in place
                keys = k_.index_select(0, meta.key_rows), v_.index_select(0, meta.key_rows)
            pieces = attention_cpu.per_sequence(
                q_, KeySource(*keys, meta), causal=opts["causal"], scale=opts["scale"],
                window=opts["window"], softcap=opts["softcap"],
            )
            out = torch.cat(pieces) if pieces else q_
            inputs = [t for t in (q_, k_, v_) if t.requires_grad]
            grads = iter(torch.autograd.grad(out, inputs, grad_out) if inputs else ())
        return tuple(next(grads) if t.requires_grad else None for t in (q, k, v)) + (None, None)
