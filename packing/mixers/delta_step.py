"""The gated delta rule's decode step (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo-hybrid) in place
on the generator's state slots.

A decode step runs one token of every sequence from its ``(heads, K, V)`` state. transformers'
token-by-token rule (``torch_recurrent_gated_delta_rule``, what HF's own decode and nopad's
decode called) allocates a new state for each of its five passes over it and returns a new final
state, which the generator then copied back into the slots. Here the same ops run in the same
order on the same shapes, so every value keeps its bits, but the state is decayed and updated in
place and the three products that are summed share one scratch buffer: a decode step's states are
most of its memory traffic. :func:`matches` checks once per function that the module's rule
computes this.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nopad.packing.mixers.chunked_delta_rule import _l2norm
from nopad.packing.mixers.chunks import probe_inputs

_MATCHES: dict[Callable, bool] = {}


def gated_delta_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
) -> torch.Tensor:
    """One token of each of ``N`` sequences (``query``/``key`` ``(1, N, H, K)``, ``value``
    ``(1, N, HV, V)``, ``g``/``beta`` ``(1, N, HV)``) from ``state`` ``(N, HV, K, V)`` fp32, which
    is updated in place. Returns the output ``(1, N, HV, V)`` in ``query``'s dtype.

    The ops of transformers' token-by-token rule called with each sequence a batch row of one
    token (as HF's decode calls it): the tensors are laid out and normalised as that function lays
    them, and ``state * decay``, ``state + k delta`` become ``mul_`` and ``add_``."""
    dtype, heads = query.dtype, value.shape[2]
    # lists, not generators: a generator is a Python call per item, and this runs per layer and step
    query, key, value, g, beta = [t.transpose(0, 1) for t in (query, key, value, g, beta)]  # (N, 1, ...)
    if key.shape[2] != heads:  # grouped value heads: each q/k head serves several
        query, key = [t.repeat_interleave(heads // key.shape[2], dim=2) for t in (query, key)]
    query, key, value, beta, g = [
        t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for t in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query / (query.shape[-1] ** 0.5)
    q, k, v = query[:, :, 0], key[:, :, 0], value[:, :, 0]
    state.mul_(g[:, :, 0].exp()[..., None, None])
    scratch = torch.empty_like(state)
    kv_mem = torch.mul(state, k.unsqueeze(-1), out=scratch).sum(dim=-2)
    delta = (v - kv_mem) * beta[:, :, 0].unsqueeze(-1)
    state.add_(torch.mul(k.unsqueeze(-1), delta.unsqueeze(-2), out=scratch))
    return torch.mul(state, q.unsqueeze(-1), out=scratch).sum(dim=-2).to(dtype)[None]


@torch._dynamo.assume_constant_result
def matches(recurrent: Callable) -> bool:
    """Whether :func:`gated_delta_step` computes what ``recurrent`` (a module's token-by-token
    gated delta rule, transformers' torch function) does for one token per sequence: tried once
    per function on a tiny step with grouped value heads, so that a release whose rule computes
    something else keeps running its own function, not this one. A constant to dynamo (run as it
    traces a compiled decode step, no graph break)."""
    if recurrent not in _MATCHES:
        q, k, v, g, beta, state = probe_inputs(
            [(1, 2, 2, 4), (1, 2, 2, 4), (1, 2, 4, 3), (1, 2, 4), (1, 2, 4), (2, 4, 4, 3)]
        )
        g, beta, theirs = -g.abs(), beta.abs().clamp(max=1), state.clone()
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):  # fp32, whatever the caller's mode
                ours = gated_delta_step(q, k, v, g, beta, state, use_qk_l2norm_in_kernel=True)
                rows = (t.transpose(0, 1) for t in (q, k, v, g, beta))
                out, theirs = recurrent(
                    *rows, initial_state=theirs, output_final_state=True, use_qk_l2norm_in_kernel=True
                )
            close = dict(rtol=1e-5, atol=1e-6)
            _MATCHES[recurrent] = torch.allclose(ours, out.transpose(0, 1), **close) and torch.allclose(
                state, theirs, **close
            )
        except Exception:  # noqa: BLE001 - a rule that cannot run the probe is not this rule either
            _MATCHES[recurrent] = False
    return _MATCHES[recurrent]
