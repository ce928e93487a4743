"""The chunked gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo-hybrid) on many pieces
of a row at once: nopad's own varlen reference, on CPU and on CUDA without ``fla``.

transformers' ``torch_chunk_gated_delta_rule`` runs one right-padded batch: every sequence pays
for the longest one's chunks, and its scan over chunks runs the longest one's count of steps.
Called piece group by piece group instead (as nopad did first), a row's scan ran one loop per
distinct chunk count, each step a batch of one or two pieces. Here every piece is cut into its
own chunks (the last one zero-padded, which is exact: ``k = v = q = 0``, ``beta = 0`` and decay
``g = 0`` leave the state as it is, as the transformers function's own padding does), the chunks
laid out chunk-major with the pieces of most chunks first. The intra-chunk work (the UT system,
its triangular solves, the in-chunk attention) then runs once over every real chunk of the row,
and the scan over chunks runs the longest piece's count of steps, step ``j`` a contiguous block:
the pieces that still have a ``j``-th chunk, a prefix of the state batch. The arithmetic per chunk
is the transformers function's, step for step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from nopad.packing.mixers.chunks import (
    carry_states,
    chunk_layout,
    flushed_exp,
    gather_chunks,
    piece_positions,
    probe_inputs,
)

logger = logging.getLogger(__name__)
_MATCHES: dict[Callable, bool] = {}


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm of the delta rules' queries and keys."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunked_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: Sequence[int],
    lengths: Sequence[int],
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the pieces ``starts[i] : starts[i] + lengths[i]`` of a row
    (``query``/``key`` ``(1, T, H, K)``, ``value`` ``(1, T, HV, V)``, ``g``/``beta`` ``(1, T, HV)``),
    each from ``initial_state[i]`` (``(N, HV, K, V)``; None: zero). Returns the pieces' outputs
    ``(sum(lengths), HV, V)``, their rows concatenated in piece order, and their final states
    ``(N, HV, K, V)`` in fp32."""
    total, heads, head_v = value.shape[1], value.shape[2], value.shape[3]
    index, active, order = chunk_layout(starts, lengths, total, chunk_size)
    gather = torch.from_numpy(index).to(value.device)

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (1, T, heads, ...) -> (C, heads, chunk, ...) fp32
        t = gather_chunks(t[0], gather)
        if t.dim() == 4 and t.shape[2] != heads:  # grouped value heads: each q/k head serves several
            t = t.repeat_interleave(heads // t.shape[2], dim=2)
        return t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)

    q, k, v, beta_, decay = (chunks(t) for t in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * q.shape[-1] ** -0.5
    v_beta, k_beta = v * beta_[..., None], k * beta_[..., None]
    cum = decay.cumsum(dim=-1)  # (C, heads, chunk): log decay from the chunk's start
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=value.device).triu(1)
    pairwise = flushed_exp((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    from_start = flushed_exp(cum)[..., None]
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * from_start, upper=False, unitriangular=True)
    q = q * from_start
    k = k * flushed_exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = flushed_exp(cum[..., -1])[..., None, None]

    if initial_state is None:
        initial_state = value.new_zeros((len(order), heads, key.shape[-1], head_v), dtype=torch.float32)

    def step(block: slice, state: torch.Tensor):
        v_new = new_values[block] - k_cumdecay[block] @ state
        out = q[block] @ state + intra[block] @ v_new
        return out, state * chunk_decay[block] + k[block].transpose(-1, -2) @ v_new

    out, final = carry_states(active, order, initial_state.to(torch.float32), step)
    out = out.transpose(1, 2).reshape(-1, heads, head_v)  # (C * chunk, HV, V)
    positions = torch.from_numpy(piece_positions(index, starts, lengths)).to(value.device)
    return out[positions].to(query.dtype), final


@torch.compiler.disable
def matches(reference: Callable) -> bool:
    """Whether this rule computes what ``reference`` does: a transformers function made under the
    kernel name ``chunk_gated_delta_rule``, whose contract is fla's (transformers swaps fla's in
    under that name), so it should. Tried once per function, on a tiny two-piece row with initial
    states, so that a release whose function computes something else keeps running its own
    function (reported once) instead of this one, silently."""
    if reference not in _MATCHES:
        try:
            with torch.no_grad(), torch.autocast("cpu", enabled=False):  # fp32, whatever the caller's mode
                _MATCHES[reference] = _agrees(reference)
        except Exception:  # noqa: BLE001 - a function that cannot run the probe is not this rule either
            _MATCHES[reference] = False
        if not _MATCHES[reference]:
            logger.warning(
                "nopad: %s.%s computes other than nopad's chunked gated delta rule; it runs "
                "itself on packed rows (per group of pieces)",
                reference.__module__,
                reference.__qualname__,
            )
    return _MATCHES[reference]


def _agrees(reference: Callable) -> bool:
    q, k, v, g, beta, init = probe_inputs(
        [(1, 11, 2, 4), (1, 11, 2, 4), (1, 11, 4, 3), (1, 11, 4), (1, 11, 4), (2, 4, 4, 3)]
    )
    g, beta = -g.abs(), beta.abs().clamp(max=1)
    pieces = [(0, 7), (7, 11)]
    ours, our_final = chunked_gated_delta_rule(
        q, k, v, g, beta, [0, 7], [7, 4], initial_state=init, chunk_size=4, use_qk_l2norm_in_kernel=True
    )
    theirs = [
        reference(
            *(t[:, a:b] for t in (q, k, v, g, beta)),
            chunk_size=4,
            output_final_state=True,
            initial_state=init[i : i + 1],
            use_qk_l2norm_in_kernel=True,
        )
        for i, (a, b) in enumerate(pieces)
    ]
    return torch.allclose(ours, torch.cat([o[0] for o, _ in theirs]), rtol=1e-4, atol=1e-5) and torch.allclose(
        our_final, torch.cat([f for _, f in theirs]), rtol=1e-4, atol=1e-5
    )
