"""The generator's steps of a Mamba2 layer (:mod:`nopad.packing.mixers.mamba2` hooks them in): each
sequence of a step continues its convolution and SSM scan from its state slot
(:mod:`nopad.inference.state_cache`) and leaves its final state there."""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from nopad.packing import invariance
from nopad.packing.mixers import chunked_ssd
from nopad.packing.mixers.chunks import probe_inputs
from nopad.packing.mixers.conv import varlen_causal_conv1d
from nopad.packing.mixers.hf_kernels import CONV, RECURRENT
from nopad.packing.mixers.kernels import package_function
from nopad.packing.mixers.ssm_steps import discretise_dt, token_scan
from nopad.packing.varlen import VarlenMeta

_MATCHES: dict[Callable, bool] = {}
# mamba_ssm's one-token step, which each Mamba2 mixer's module calls where it is installed
STEP_KERNEL = ("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")


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
    one-token sequences: :func:`recurrent_step` all at once, in place in their slots (``update``:
    the module's own recurrent step, which runs mamba_ssm's kernel where chosen). The
    forward's other keyword arguments (``**_``: the model's, nopad's) are not the scan's."""
    scan = dict(D=D, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)

    def run(meta: VarlenMeta, initial: torch.Tensor):
        check_row(hidden_states.shape[0], hidden_states.shape[1], meta, "mamba2_chunk_scan")
        if meta.is_static:  # a static decode step: one token a row, no host lengths or package look-up (capturable)
            out, finals = recurrent_step(
                None, hidden_states[0], dt[0], A, B[0], C[0], None if z is None else z[0], initial, **scan
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
    ``C``: ``(N, groups, state)``) from ``state`` ``(N, heads, head_dim, state)`` fp32, which it
    updates in place; returns the output and ``state``. ``dt`` is discretised first, as the chunk
    scan does it, so that ``dt_limit`` applies too. Where mamba_ssm's step kernel is chosen
    (:func:`~nopad.packing.mixers.kernels.package_function`), ``update`` (the module's step, which
    calls it) runs, as the mixer's own decode calls it; else (and with no ``update``: a static
    step) :func:`torch_step`."""
    dt = discretise_dt(dt, dt_bias, dt_softplus, dt_limit)
    if update is None or package_function(*STEP_KERNEL, x) is None:
        return torch_step(x, dt, A, B, C, D, z, state), state
    head_dim, size = x.shape[-1], B.shape[-1]
    expand = dict(D=None if D is None else D[:, None].expand(-1, head_dim), z=z, dt_bias=None, dt_softplus=False)
    dt, A = dt[..., None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, size)
    return update(state, x, dt, A, B, C, **expand), state


def torch_step(x, dt, A, B, C, D, z, state: torch.Tensor) -> torch.Tensor:
    """The arithmetic of transformers' ``mamba2_selective_state_update`` (``dt`` discretised;
    :func:`matches` checks it), op for op, except that the decay ``exp(A dt)`` and ``dt B`` are
    computed once per head, not broadcast over the state first, and ``state`` is updated in
    place: a decode step's states are most of its memory traffic, and this makes 3 passes over
    them where that function made 8 (and the generator copied them twice more). Returns the output."""
    heads, head_dim, size = x.shape[1], x.shape[2], B.shape[-1]
    state.mul_(torch.exp(dt.float() * A.float())[..., None, None])
    B, C = [t.repeat_interleave(heads // t.shape[1], dim=1) for t in (B, C)]  # each head its group's
    state.add_((dt[..., None] * B)[:, :, None, :] * x[..., None])
    out = torch.bmm(state.to(C.dtype).view(-1, head_dim, size), C.reshape(-1, size, 1)).view(x.shape)
    if D is not None:
        out = (out + x * D[:, None]).to(out.dtype)
    if z is not None:
        out = out * F.silu(z)
    return out.to(x.dtype)


@torch.compiler.disable
def matches(update: Callable) -> bool:
    """Whether :func:`torch_step` computes what ``update`` (a family's
    ``mamba2_selective_state_update``; its torch function is tried) does, called as its mixer's
    decode calls it: once per function, on a tiny step, so that a release whose step computes
    something else leaves its family refused in the generator, not computed by this one."""
    if update not in _MATCHES:
        shapes = [(2, 4, 3), (2, 4), (4,), (2, 2, 5), (2, 2, 5), (4,), (2, 4, 3), (2, 4, 3, 5)]
        x, dt, A, B, C, D, z, state = probe_inputs(shapes)
        dt, A, theirs = dt.abs(), -A.abs() - 0.5, state.clone()
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):  # fp32, whatever the caller's mode
                their_out = inspect.unwrap(update)(
                    theirs,
                    x,
                    dt[..., None].expand(-1, -1, 3),
                    A[:, None, None].expand(-1, 3, 5),
                    B,
                    C,
                    D[:, None].expand(-1, 3),
                    z=z,
                    dt_bias=None,
                    dt_softplus=False,
                )
                out, ours = torch_step(x, dt, A, B, C, D, z, state), state
            _MATCHES[update] = torch.allclose(out, their_out, rtol=1e-5, atol=1e-6) and torch.allclose(
                ours, theirs, rtol=1e-5, atol=1e-6
            )
        except Exception:  # noqa: BLE001 - a step that cannot run the probe is not this step either
            _MATCHES[update] = False
    return _MATCHES[update]
