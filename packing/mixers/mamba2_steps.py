"""The generator's steps of a Mamba2 layer (:mod:`nopad.packing.mixers.mamba2` hooks them in): each
sequence of a step continues its convolution and SSM scan from its state slot
(:mod:`nopad.inference.state_cache`) and leaves its final state there."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch

from nopad.packing import invariance
from nopad.packing.mixers import chunked_ssd
from nopad.packing.mixers.conv import varlen_causal_conv1d
from nopad.packing.mixers.hf_kernels import CONV, RECURRENT
from nopad.packing.mixers.ssm_steps import discretise_dt, token_scan
from nopad.packing.varlen import VarlenMeta


def check_row(batch: int, length: int, meta: VarlenMeta, what: str) -> None:
    if batch != 1 or length != meta.total_q:
        raise ValueError(
            f"{what}: nopad_meta describes one row of {meta.total_q} tokens, but the layer got "
            f"a batch of {batch} x {length}; pass the packed row as input_ids (1, T) with no "
            "cache"
        )


def step_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, states
) -> torch.Tensor:
    """The causal conv of a generator step (``x``: ``(1, dim, T)``): each sequence continues
    from the last inputs in its state slot."""

    def run(meta: VarlenMeta, initial: torch.Tensor):
        check_row(x.shape[0], x.shape[-1], meta, "causal_conv1d_fn")
        return varlen_causal_conv1d(
            x[0], weight, bias, activation, meta=meta, initial_states=initial, return_final_states=True
        )

    return states.run(CONV, run)[None]


def step_chunk_scan(
    update,
    hidden_states,
    dt,
    A,
    B,
    C,
    chunk_size,
    states,
    *,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    **_,
):
    """The SSD scan of a generator step: each sequence continues from the SSM state in its slot.
    Sequences of several tokens: nopad's own chunked scan, all at once, each from its slot;
    one-token sequences: ``update`` (the module's recurrent step) all at once. The
    forward's other keyword arguments (``**_``: the model's, nopad's) are not the scan's."""
    scan = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)

    def run(meta: VarlenMeta, initial: torch.Tensor):
        check_row(hidden_states.shape[0], hidden_states.shape[1], meta, "mamba2_chunk_scan")
        if meta.is_static:  # a static decode step: one token a row, no host lengths (capturable)
            out, finals = recurrent_step(
                update, hidden_states[0], dt[0], A, B[0], C[0], None if z is None else z[0], initial, **scan
            )
            return out[None], finals
        cu = [0, *itertools.accumulate(meta.seqlens_q)]  # host-side: no device sync
        if invariance.is_enabled():  # token by token, as the trainer's rows run in the mode
            values, finals = token_scan(
                hidden_states[0], dt[0], A, B[0], C[0], list(zip(cu[:-1], cu[1:])), initial, **scan
            )
            return values[None], finals
        single = [i for i, n in enumerate(meta.seqlens_q) if n == 1]
        if len(single) == len(cu) - 1:  # a decode step: every row one sequence's token, in order
            out, finals = recurrent_step(
                update, hidden_states[0], dt[0], A, B[0], C[0], None if z is None else z[0], initial, **scan
            )
            return out[None], finals
        finals = initial.clone()
        parts: list[tuple[int, torch.Tensor]] = []  # (first row, output rows)
        if single:
            rows = torch.tensor([cu[i] for i in single], device=hidden_states.device)
            out, finals[single] = recurrent_step(
                update,
                hidden_states[0, rows],
                dt[0, rows],
                A,
                B[0, rows],
                C[0, rows],
                None if z is None else z[0, rows],
                initial[single],
                **scan,
            )
            parts += [(cu[i], out[j : j + 1]) for j, i in enumerate(single)]
        longer = [i for i, n in enumerate(meta.seqlens_q) if n > 1]
        if longer:  # nopad's own chunked scan, every longer sequence at once from its slot
            pieces = [(cu[i], cu[i + 1]) for i in longer]
            out, finals[longer] = chunked_ssd.chunked_ssd_scan(
                hidden_states[0], dt[0], A, B[0], C[0], pieces, initial[longer], chunk_size=chunk_size, **scan
            )
            ends = np.cumsum([0] + [end - start for start, end in pieces])
            parts += [(cu[i], out[ends[j] : ends[j + 1]]) for j, i in enumerate(longer)]
        parts.sort(key=lambda part: part[0])
        dtype = functools.reduce(torch.promote_types, (p.dtype for _, p in parts))
        return torch.cat([p.to(dtype) for _, p in parts])[None], finals

    return states.run(RECURRENT, run)


def recurrent_step(update, x, dt, A, B, C, z, state, *, D, dt_bias, dt_softplus, dt_limit):
    """One token of each sequence (``x``: ``(N, heads, head_dim)``, ``dt``: ``(N, heads)``, ``B``,
    ``C``: ``(N, groups, state)``) from ``state`` ``(N, heads, head_dim, state)``: the module's
    recurrent step, called as its mixer's decode calls it; ``dt`` is discretised here first, as
    the chunk scan does it, so that ``dt_limit`` applies too. Returns the output and new state."""
    head_dim, size = x.shape[-1], B.shape[-1]
    dt = discretise_dt(dt, dt_bias, dt_softplus, dt_limit)
    state = state.clone()
    out = update(
        state,
        x,
        dt[..., None].expand(-1, -1, head_dim),
        A[:, None, None].expand(-1, head_dim, size),
        B,
        C,
        None if D is None else D[:, None].expand(-1, head_dim),
        z=z,
        dt_bias=None,
        dt_softplus=False,
    )
    return out, state
