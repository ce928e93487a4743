"""Mamba2's chunked SSD scan (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1) on many pieces of a
row at once: nopad's own varlen reference, on CPU and on CUDA without mamba_ssm.

transformers' ``mamba2_chunk_scan`` (the torch fallback of mamba_ssm's
``mamba_chunk_scan_combined``, the same function in every Mamba2 family) takes one batch, so a
packed row ran it once per piece, one after another. Here the pieces are cut into chunks laid out
chunk-major (:func:`nopad.packing.mixers.chunks.chunk_layout`): the in-chunk terms (the masked
``C B`` scores, each chunk's own state) run once over every real chunk of the row, and the state
passes from chunk to chunk in one loop of the longest piece's count of steps, step ``j`` a prefix
of the state batch. A padded position has ``dt x = 0``, ``B = C = 0`` and ``A dt = 0``: it adds
nothing and decays nothing. The arithmetic is transformers', with its stable segment sum; the
inter-chunk pass is its recurrence written as a loop, and every ``exp`` of a decay flushes
subnormals to 0 (:func:`nopad.packing.mixers.chunks.flushed_exp`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nopad.packing.mixers.chunks import (
    carry_states,
    chunk_layout,
    flushed_exp,
    gather_chunks,
    piece_positions,
    piece_rows,
    probe_inputs,
)
from nopad.packing.mixers.ssm_steps import discretise_dt


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = x[..., j+1] + ... + x[..., i]`` for ``i >= j``, ``-inf`` above: summed
    from the masked cumulative sum (as transformers does), not as a difference of two long
    cumulative sums, which would cancel."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = x.masked_fill(~below, 0).cumsum(dim=-2)
    on_or_below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), diagonal=0)
    return sums.masked_fill(~on_or_below, float("-inf"))


def chunked_ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    pieces: Sequence[tuple[int, int]],
    initial_states: torch.Tensor | None = None,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over the ``pieces`` (``[start, end)`` rows each) of a row (``x``
    ``(T, heads, head_dim)``, ``dt`` ``(T, heads)``, ``A`` ``(heads,)``, ``B``/``C`` ``(T, groups,
    state)``), each from ``initial_states[i]`` (``(N, heads, head_dim, state)``; None: zero).
    Returns the fp32 outputs ``(rows, heads, head_dim)``, the pieces' rows concatenated in piece
    order, and the fp32 final states ``(N, heads, head_dim, state)``: what
    :func:`nopad.packing.mixers.ssm_steps.token_scan` returns, in chunks instead of token by token."""
    total, heads, head_dim = x.shape
    starts, lengths = [start for start, _ in pieces], [end - start for start, end in pieces]
    index, active, order = chunk_layout(starts, lengths, total, chunk_size)
    gather = torch.from_numpy(index).to(x.device)
    dt = discretise_dt(dt, dt_bias, dt_softplus, dt_limit).float()
    xs = gather_chunks(x.float() * dt[..., None], gather)  # (Cn, L, heads, head_dim)
    a = gather_chunks(A.float() * dt, gather).transpose(1, 2)  # (Cn, heads, L)
    b, c = (gather_chunks(t.float().repeat_interleave(heads // t.shape[1], dim=1), gather) for t in (B, C))
    a_cum = a.cumsum(dim=-1)
    scores = torch.einsum("clhn,cshn->clsh", c, b) * flushed_exp(_segment_sum(a)).permute(0, 2, 3, 1)
    y = torch.einsum("clsh,cshp->clhp", scores, xs)
    to_end = flushed_exp(a_cum[..., -1:] - a_cum).transpose(1, 2)[..., None]  # (Cn, L, heads, 1)
    chunk_states = torch.einsum("clhn,clhp->chpn", b * to_end, xs)
    chunk_decay = flushed_exp(a_cum[..., -1])[..., None, None]  # (Cn, heads, 1, 1)

    if initial_states is None:
        initial_states = x.new_zeros((len(pieces), heads, head_dim, B.shape[-1]), dtype=torch.float32)

    def step(block: slice, state: torch.Tensor):  # a chunk reads the state it enters with
        return state, state * chunk_decay[block] + chunk_states[block]

    entering, final = carry_states(active, order, initial_states.to(torch.float32), step)
    from_start = flushed_exp(a_cum).transpose(1, 2)[..., None]  # (Cn, L, heads, 1)
    y = y + torch.einsum("clhn,chpn->clhp", c, entering) * from_start
    positions = torch.from_numpy(piece_positions(index, starts, lengths)).to(x.device)
    out = y.reshape(-1, heads, head_dim)[positions]
    if D is not None:
        out = out + D[:, None] * x.float()[torch.from_numpy(piece_rows(starts, lengths)).to(x.device)]
    return out, final


def matches(reference: Callable) -> bool:
    """Whether this scan computes what ``reference`` (a family's ``mamba2_chunk_scan``, transformers'
    torch fallback of mamba_ssm's ``mamba_chunk_scan_combined``) does, on a tiny two-piece row with
    initial states, ``D``, ``dt_bias``, softplus and a ``dt_limit``: a release whose scan computes
    something else leaves its family refused (:func:`nopad.packing.mixers.mamba2.install`), not silently
    computed by this one."""
    shapes = [(11, 4, 3), (11, 4), (4,), (11, 2, 5), (11, 2, 5), (4,), (4,), (2, 4, 3, 5)]
    x, dt, A, B, C, D, bias, init = probe_inputs(shapes)
    options = dict(D=D, dt_bias=bias, dt_softplus=True, dt_limit=(0.4, 0.9))  # the clamp bites on both ends
    A = -A.abs() - 0.5
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # fp32, whatever the caller runs under
            ours, our_final = chunked_ssd_scan(x, dt, A, B, C, [(0, 7), (7, 11)], init, chunk_size=4, **options)
            theirs = [
                reference(
                    x[None, a:b],
                    dt[None, a:b],
                    A,
                    B[None, a:b],
                    C[None, a:b],
                    4,
                    initial_states=init[i : i + 1],
                    return_final_states=True,
                    **options,
                )
                for i, (a, b) in enumerate([(0, 7), (7, 11)])
            ]
    except Exception:  # noqa: BLE001 - a scan that cannot run the probe is not this scan either
        return False
    return torch.allclose(ours, torch.cat([o[0] for o, _ in theirs]).float(), rtol=1e-4, atol=1e-5) and torch.allclose(
        our_final, torch.cat([f for _, f in theirs]).float(), rtol=1e-4, atol=1e-5
    )
