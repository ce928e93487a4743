"""The Mamba2 state-space scan token by token: the one order :func:`nopad.packing.batch_invariant`
runs for a Mamba2 layer, in the trainer's packed and tree rows and in the generator's steps.

Why: transformers' chunked SSD scan (``mamba2_chunk_scan``) sums over a chunk's positions and
chunks, so a token's bits depend on where it falls in its chunk: a token of a decode step, of a
prefill chunk and of a training row came out different, and rollout log-probs did not equal the
trainer's. Here every token does the same ops whatever the row's length, chunking and batch:
``dt`` discretised as the chunk scan does it (bias, softplus, ``dt_limit``), then per token, in
fp32 (as the chunk scan computes), ``state = state * exp(A dt) + (dt x) B`` and ``y = sum_n
state C + D x``. The only reduction is over the state size, the last dim of a contiguous tensor,
which torch sums per output in one order whatever the number of outputs on CPU; on CUDA torch
may split it by the batch's shape, so the mode's Triton kernel set runs that ``sum`` instead.
The pieces of a call run as one right-padded batch; a padded step has ``exp(A dt) = 1`` and
``dt x = 0``, so it leaves the state as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from nopad.packing.mixers.recurrence import RecurrencePlan

# the chunk scan's keywords this scan takes too (all but chunk_size, which it has no use for)
OPTIONS = ("D", "dt_bias", "dt_softplus", "dt_limit")


def discretise_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """``dt`` as transformers' chunk scan discretises it (bias, softplus, clamp to ``dt_limit``)."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def token_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    pieces: list[tuple[int, int]],
    starts: torch.Tensor | None,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of the row's ``pieces`` (``[start, end)`` rows each), each from its start state.

    ``x``: ``(T, heads, head_dim)``; ``dt``: ``(T, heads)``; ``A``: ``(heads,)``; ``B``, ``C``:
    ``(T, groups, state)``; ``starts``: ``(N, heads, head_dim, state)`` (None: zeros). Returns
    the pieces' rows' fp32 outputs ``(rows, heads, head_dim)``, piece after piece, and each
    piece's final state ``(N, heads, head_dim, state)`` fp32."""
    total, heads, head_dim = x.shape
    dt = discretise_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    decay = torch.exp(A.float() * dt)  # (T, heads)
    dx = x.float() * dt[..., None]  # (T, heads, head_dim)
    B = B.float().repeat_interleave(heads // B.shape[1], dim=1)  # (T, heads, state)
    C = C.float().repeat_interleave(heads // C.shape[1], dim=1)
    # row `total`: the padding row (no decay, no input)
    decay, dx, B, C = (
        torch.cat([t, t.new_full((1, *t.shape[1:]), 1.0 if i == 0 else 0.0)]) for i, t in enumerate((decay, dx, B, C))
    )
    lengths = np.asarray([end - start for start, end in pieces], dtype=np.int64)
    width = int(lengths.max(initial=0))
    index = np.full((width, len(pieces)), total, dtype=np.int64)  # step t: each piece's row
    for i, (start, end) in enumerate(pieces):
        index[: end - start, i] = np.arange(start, end)
    index_t = torch.from_numpy(index).to(x.device)
    state = (
        x.new_zeros((len(pieces), heads, head_dim, B.shape[-1]), dtype=torch.float32)
        if starts is None
        else starts.to(torch.float32).clone()
    )
    outs = []
    # gathered once, step by step (one gather and one backward for the whole row, not one per step)
    for decay_t, dx_t, B_t, C_t in zip(*(t[index_t].unbind(0) for t in (decay, dx, B, C))):
        state = state * decay_t[..., None, None] + dx_t[..., None] * B_t[:, :, None, :]
        outs.append((state * C_t[:, :, None, :]).sum(-1))
    valid = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None]).to(x.device)
    out = torch.stack(outs, 1)[valid] if width else x.new_zeros((0, heads, head_dim), dtype=torch.float32)
    if D is not None:
        out = out + D[:, None] * x.float()[index_t.t()[valid]]
    return out, state


def row_scan(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    plan: RecurrencePlan,
    kwargs: dict,
    scan_pieces: Callable = token_scan,
) -> torch.Tensor:
    """The scan of a packed or tree row (``hidden_states``: ``(1, T, heads, head_dim)``, the
    others as transformers' chunk scan takes them; ``kwargs``: that call's keywords), wave by
    wave of the row's ``plan``, each piece from its parent's final state. ``scan_pieces`` runs a
    wave: :func:`token_scan` (the batch-invariant order) or nopad's chunked scan
    (:func:`nopad.packing.mixers.chunked_ssd.chunked_ssd_scan`), which take the same arguments.
    Returns the fp32 output ``(1, T, heads, head_dim)``."""
    scan = {k: kwargs[k] for k in OPTIONS if k in kwargs}
    x, dt, B, C = hidden_states[0], dt[0], B[0], C[0]
    zero = x.new_zeros((x.shape[1], x.shape[2], B.shape[-1]), dtype=torch.float32)
    finals: dict[int, torch.Tensor] = {}
    out = x.new_zeros(x.shape, dtype=torch.float32)
    for wave in plan.waves:
        pieces = [plan.pieces[p] for p in wave]
        starts = None
        if any(piece.parent >= 0 for piece in pieces):
            starts = torch.stack([finals[piece.parent] if piece.parent >= 0 else zero for piece in pieces])
        values, ends = scan_pieces(x, dt, A, B, C, [(p.start, p.end) for p in pieces], starts, **scan)
        rows = torch.cat([torch.arange(p.start, p.end, device=x.device) for p in pieces])
        out = out.index_copy(0, rows, values)
        finals.update(zip(wave, ends))
    return out[None]
