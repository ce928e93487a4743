"""Host-side length arithmetic of a varlen row: validated lengths, their prefix sums, and a step's
boundaries (:func:`step_layout`), shared by :class:`~nopad.packing.varlen.VarlenMeta` and the
generator's step builder."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def as_lengths(values: Sequence[int] | np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """Validate a 1-D array of non-negative integer lengths and return it as int64 numpy."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {arr[i]} is negative; lengths must be >= 0")
    return arr


def cumsum0(lengths: np.ndarray) -> np.ndarray:
    out = np.empty(lengths.size + 1, dtype=np.int64)
    out[0] = 0
    np.add.accumulate(lengths, dtype=np.int64, out=out[1:])  # (np.cumsum with out= is twice as slow)
    return out


def step_layout(query_lens, context_lens) -> dict[str, np.ndarray]:
    """Host (numpy int64) arrays of a step's boundaries: ``q``/``k`` lengths, ``cu_q``/``cu_k``,
    each query token's ``positions`` and ``seq_idx``. Shared by :meth:`VarlenMeta.for_step` and
    the generator's step builder, which copies them to the device in one buffer."""
    q = as_lengths(query_lens, "query_lens")
    ctx = as_lengths(context_lens, "context_lens")
    if q.shape != ctx.shape:
        raise ValueError(f"query_lens and context_lens must have the same length, got {q.size} and {ctx.size}")
    k = q + ctx
    cu_q, cu_k = cumsum0(q), cumsum0(k)
    total_q = int(cu_q[-1])
    if total_q >= 2**31 or int(cu_k[-1]) >= 2**31:
        raise ValueError("more than 2**31 tokens in one row; split the batch")
    seq_idx = np.repeat(np.arange(q.size, dtype=np.int64), q)
    # position of token t of sequence i = ctx[i] + (t - cu_q[i])
    positions = np.arange(total_q, dtype=np.int64) - np.repeat(cu_q[:-1] - ctx, q)
    return dict(q=q, k=k, cu_q=cu_q, cu_k=cu_k, positions=positions, seq_idx=seq_idx)
