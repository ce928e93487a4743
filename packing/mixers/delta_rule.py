"""The chunked delta rules (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo-hybrid; Kimi's KDA) on a
varlen row, each sequence apart, tree segments continuing their parent's state.

The rows run wave by wave (:mod:`nopad.packing.mixers.recurrence`). Reference (CPU, and CUDA without
``fla``): for the Gated DeltaNet rule, nopad's own chunk-major varlen rule
(:mod:`nopad.packing.mixers.chunked_delta_rule`: every piece of the wave in one call, each from its
initial state, the transformers function's arithmetic chunk for chunk); for Kimi's KDA, the
layer's own torch function (``chunk_kimi_delta_attention``) on the wave's pieces as a
right-padded batch, pieces batched by their number of chunks so no piece pays for a longer one.
Padding is exact: a padded token has ``k = v = q = 0``, ``beta = 0`` and decay ``g = 0``, so it
leaves the state as it is, just as the function's own padding to a multiple of its chunk does.
CUDA with ``fla`` installed: one varlen call per wave, ``cu_seqlens`` and the pieces'
initial states (fla's documented signature), the way packed training runs there.

Inside :func:`nopad.packing.batch_invariant` every row runs the layer's *token-by-token* rule instead
(transformers' ``torch_recurrent_gated_delta_rule`` / ``recurrent_kimi_delta_attention``, the
functions its cached decode calls), each wave's pieces as one right-padded batch. The chunked
rule's sums depend on where a token falls in its chunk, so a token computed in a decode step, a
prefill chunk and a training row got different bits; the recurrent rule does the same
elementwise ops and the same per-token reductions over the state in the same order whatever the
row's length, chunking and batch, so the generator's steps and the trainer's rows agree bitwise.
(Those reductions are torch ``sum`` calls over one dim: on CUDA the mode's Triton kernel set
runs them in one order per output, where torch's own would split them by the batch's shape.)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nopad.packing import invariance
from nopad.packing.mixers import chunked_delta_rule, delta_step
from nopad.packing.mixers.chunks import piece_rows
from nopad.packing.mixers.kernels import disable, package_function
from nopad.packing.mixers.recurrence import recurrence_plan
from nopad.packing.varlen import VarlenMeta

# transformers' kernel name -> fla's module and function of the same rule
FLA_FUNCTIONS = {
    "chunk_gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "chunk_kda": ("fla.ops.kda", "chunk_kda"),
}


def varlen_delta_rule(
    reference: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    meta: VarlenMeta,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    fla_kernel: str | None = "chunk_gated_delta_rule",
    chunk_size: int = 64,
    recurrent: Callable | None = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunked delta rule over ``meta``'s row (``query``/``key`` ``(1, T, H, K)``, ``value``
    ``(1, T, HV, V)``, ``g`` ``(1, T, HV)`` or ``(1, T, HV, K)``, ``beta`` ``(1, T, HV)``).

    ``reference(q, k, v, g, beta, chunk_size=, initial_state=, output_final_state=,
    use_qk_l2norm_in_kernel=)`` is the batched torch rule it runs on (returns ``(out, state)``);
    ``fla_kernel`` names fla's varlen function of the same rule (None: reference only).
    ``initial_state``: ``(N, HV, K, V)`` per sequence of a packed row. ``recurrent``: the same
    rule token by token (same call, no ``chunk_size``), which :func:`nopad.packing.batch_invariant`
    runs instead. ``in_place``: a decode step of the gated delta rule may update ``initial_state``
    (the generator's slots) in place and return it (:mod:`nopad.packing.mixers.delta_step`).
    Returns the output ``(1, T, HV, V)`` and, with ``output_final_state``, the final states."""
    _check_row(query, meta, initial_state)
    stepwise = None
    if invariance.is_enabled():
        reference, chunk_size = _invariant_rule(recurrent, query), None
    elif recurrent is not None:  # one-token pieces (decode steps) take the rule HF's decode takes
        stepwise = _token_by_token(recurrent)
    tensors, common = (query, key, value, g, beta), dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    fla = _fla_rule(fla_kernel, tensors, common, meta.is_static)
    decode = stepwise or (None if chunk_size else reference)  # the token-by-token rule, if one runs
    in_place = in_place and fla_kernel == "chunk_gated_delta_rule" and g.dim() == 3 and delta_step.matches(recurrent)
    step = _decode_step(decode, fla, tensors, meta, initial_state, common, in_place)
    if step is not None:
        return step[0], step[1] if output_final_state else None
    plan = recurrence_plan(meta)  # after the decode step, which needs none
    if fla is not None and plan.is_flat and initial_state is None:  # a packed row: one call as it is
        return fla(
            *tensors,
            initial_state=None,
            output_final_state=output_final_state,
            cu_seqlens=meta.cu_seqlens_q.to(torch.long),
            **common,
        )
    flat = plan.is_flat and all(p >= 0 for p in plan.last_piece)  # no empty sequence either
    own = _runs_own(fla, chunk_size, fla_kernel, g, reference)
    states: dict[int, torch.Tensor] = {}
    parts, part_rows, flat_finals, flat_seqs = [], [], [], []
    for wave in plan.waves:
        one_call = fla is not None or chunk_size is None  # one call per wave (the recurrent rule: no chunks)
        for group in [list(wave)] if one_call else _wave_groups(plan, wave, chunk_size, stepwise, own):
            single = stepwise is not None and fla is None and all(len(plan.pieces[p]) == 1 for p in group)
            rule, size = (stepwise, None) if single else (reference, chunk_size)
            init = _group_init(plan, group, states, initial_state, tensors)
            if own and not single:
                out, final, rows = _run_own(tensors, plan, group, init, chunk_size, common)
            else:
                out, final, rows = _run_group(rule, fla, tensors, plan, group, init, size, common)
            parts.append(out)
            part_rows.append(rows)
            if flat:  # no piece continues another: the finals are only the sequences' own
                flat_finals.append(final)
                flat_seqs.append([plan.pieces[p].seq for p in group])
                continue
            for i, p in enumerate(group):
                if plan.is_parent[p] or output_final_state:
                    states[p] = final[i]
    out = _in_row_order(parts, part_rows, query.device)[None]
    if not output_final_state:
        return out, None
    if flat:  # every sequence is one piece, its index in the row's piece order
        return out, _in_row_order(flat_finals, flat_seqs, query.device)
    finals = [states[p] if p >= 0 else _initial(initial_state, i, value, key) for i, p in enumerate(plan.last_piece)]
    return out, torch.stack(finals)


def _check_row(query: torch.Tensor, meta: VarlenMeta, initial_state: torch.Tensor | None) -> None:
    """The call errors :func:`varlen_delta_rule` names before any work: a query that is not the
    one row ``meta`` describes (a KV-cache call), or a start state on a prefix-tree row."""
    if query.shape[0] != 1 or query.shape[1] != meta.total_q:
        raise ValueError(
            f"a varlen row is (1, {meta.total_q}, ...); got query of shape "
            f"{tuple(query.shape)}. nopad rows run with use_cache=False"
        )
    if initial_state is not None and meta.key_rows is not None:
        raise ValueError("initial_state applies to packed rows; a prefix-tree segment starts from its parent")


def _runs_own(fla: Callable | None, chunk_size: int | None, fla_kernel: str | None, g, reference: Callable) -> bool:
    """Whether nopad's own chunked kernel (:mod:`nopad.packing.mixers.chunked_delta_rule`) runs the
    groups: no fla, a chunked rule, the gated delta rule with one gate per head, and a
    ``reference`` it reproduces."""
    return (
        fla is None
        and chunk_size is not None
        and fla_kernel == "chunk_gated_delta_rule"
        and g.dim() == 3
        and chunked_delta_rule.matches(reference)
    )


def _wave_groups(plan, wave, chunk_size: int, stepwise: Callable | None, own: bool) -> list[list[int]]:
    """The calls a wave's pieces run in: with transformers' chunked rule, pieces of the same number
    of chunks together (they pad to the same length anyway); nopad's own rule takes any at once;
    one-token pieces apart when a token-by-token rule runs them (padded to a whole chunk, one would
    cost 64 tokens' work)."""
    chunks = [-(-len(plan.pieces[p]) // chunk_size) for p in wave]
    if stepwise is not None:
        chunks = [0 if len(plan.pieces[p]) == 1 else c for p, c in zip(wave, chunks)]
    if own:
        chunks = [min(c, 1) for c in chunks]
    return [[p for p, c in zip(wave, chunks) if c == n] for n in sorted(set(chunks))]


def _fla_rule(kernel: str | None, tensors, common: dict, meta_is_static: bool = False) -> Callable | None:
    """fla's varlen function of ``kernel`` when it runs this call (installed and chosen, see
    :func:`package_function`; not in batch-invariant mode; its backward runs here if needed)."""
    if kernel is None or invariance.is_enabled():
        return None
    if meta_is_static:  # a static decode step: the token-by-token rule, no host lengths (capturable)
        return None
    fla = package_function(*FLA_FUNCTIONS[kernel], tensors[0])
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if fla is not None and needs_grad and not _fla_trains(kernel, fla, tensors, common):
        return None
    return fla


_BACKWARD_RUNS: set[tuple] = set()  # (kernel, device, dtype, head shapes) whose fla backward ran


def _fla_trains(kernel: str, fla: Callable, tensors, common: dict) -> bool:
    """Whether fla's backward runs here, tried once per device, dtype and head sizes on a tiny
    two-sequence row before a call that needs gradients. fla 0.6 refuses its gated backward on
    Hopper under Triton 3.4 to 3.7.0 (wrong results there, fla #640) with a RuntimeError raised
    in the backward only, after the forward ran; so it is tried here, and if it fails fla is
    disabled (reported once, with fla's message) and the reference trains instead."""
    key = (kernel, tensors[0].device, tensors[0].dtype, *(tuple(t.shape[2:]) for t in tensors))
    if key in _BACKWARD_RUNS:
        return True
    error = _backward_error(fla, [(t.shape[2:], t.dtype) for t in tensors], tensors[0].device, common)
    if error:
        disable(*FLA_FUNCTIONS[kernel], f"its backward fails on this device ({error})")
        return False
    _BACKWARD_RUNS.add(key)
    return True


def fla_backward_error(device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """Why fla's Gated DeltaNet cannot train on ``device`` (its backward's error), or None: it
    can, or fla is absent. transformers' own layer calls fla whenever it is installed, so where
    this is not None plain HF training of that layer fails too (benchmarks give their padded peer
    transformers' torch rule there)."""
    fla = package_function(*FLA_FUNCTIONS["chunk_gated_delta_rule"], torch.empty(0, device=device))
    if fla is None:
        return None
    heads = [((2, 16), dtype), ((2, 16), dtype), ((4, 16), dtype), ((4,), dtype), ((4,), dtype)]
    return _backward_error(fla, heads, torch.device(device), {"use_qk_l2norm_in_kernel": True})


def _backward_error(fla: Callable, shapes, device: torch.device, common: dict) -> str | None:
    """fla's error running forward and backward on a tiny two-sequence row of q, k, v, g, beta of
    these per-token shapes and dtypes, or None."""
    tiny = []
    for i, (shape, dtype) in enumerate(shapes):  # g is a log decay (<= 0), beta in [0, 1]; no RNG
        shape = (1, 5, *shape)
        x = torch.arange(int(np.prod(shape)), device=device, dtype=torch.float32).add(i).sin()
        x = x.reshape(shape)
        tiny.append((-x.abs() if i == 3 else x.abs() if i == 4 else x).to(dtype).requires_grad_())
    cu = torch.tensor([0, 3, 5], dtype=torch.long, device=device)
    try:
        with torch.enable_grad():
            out, _ = fla(*tiny, initial_state=None, output_final_state=False, cu_seqlens=cu, **common)
            out.float().sum().backward()
    except Exception as error:  # noqa: BLE001 - whatever fla raises, it cannot train here
        return f"{type(error).__name__}: {error}"
    return None


def _decode_step(
    rule: Callable | None,
    fla,
    tensors,
    meta: VarlenMeta,
    initial_state: torch.Tensor | None,
    common: dict,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step (one token per sequence, each from its slot): the one batched call of the
    token-by-token ``rule`` that the row's plan would make, without building the plan (six
    layers' worth of Python per step), or with ``in_place`` its ops on ``initial_state`` itself.
    Returns the output ``(1, N, HV, V)`` and the finals; None when the row is not such a step
    (or no token-by-token rule runs it, or fla does)."""
    one_each = meta.is_static or (meta.max_seqlen_q == 1 and meta.total_q == meta.num_seqs)
    if meta.is_static and (rule is None or initial_state is None):
        raise ValueError(
            "a static decode step of a delta rule runs its token-by-token rule from each row's "
            "state; this layer's module has no token-by-token rule (or no state was given)"
        )
    if rule is None or fla is not None or initial_state is None or meta.key_rows is not None or not one_each:
        return None
    if in_place and initial_state.dtype == torch.float32:
        return delta_step.gated_delta_step(*tensors, initial_state, **common), initial_state
    rows = (t.transpose(0, 1) for t in tensors)  # (N, 1, ...): each sequence a batch row of one step
    out, final = rule(*rows, initial_state=initial_state.to(torch.float32), output_final_state=True, **common)
    return out.transpose(0, 1), final


def _in_row_order(parts: list[torch.Tensor], part_rows: list, device) -> torch.Tensor:
    """``parts`` (their rows ``part_rows``, concatenated) put back in row order, with no gather
    where they already are (a decode step: one part, every row in order)."""
    rows = np.concatenate(part_rows)
    cat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if np.array_equal(rows, np.arange(rows.size)):
        return cat
    return cat[torch.from_numpy(np.argsort(rows)).to(device)]


def _group_init(
    plan, group: list[int], states: dict, initial_state: torch.Tensor | None, tensors
) -> torch.Tensor | None:
    """The pieces' start states ``(len(group), HV, K, V)`` in fp32 (None: all zero); one gather
    when every piece starts from the caller's initial state (a packed row, a generator step)."""
    pieces = [plan.pieces[p] for p in group]
    if all(piece.parent < 0 for piece in pieces):
        if initial_state is None:
            return None
        seqs = [piece.seq for piece in pieces]
        if seqs == list(range(initial_state.shape[0])):
            return initial_state.to(torch.float32)
        return initial_state[torch.tensor(seqs, device=initial_state.device)].to(torch.float32)
    starts = [_start_state(plan, p, states, initial_state) for p in group]
    zero = _zero_state(tensors)
    return torch.stack([zero if s is None else s.to(zero.dtype) for s in starts])


def _invariant_rule(recurrent: Callable | None, query: torch.Tensor) -> Callable:
    """The token-by-token rule :func:`nopad.packing.batch_invariant` runs, or a clear refusal."""
    if recurrent is None:
        raise ValueError(
            "nopad.packing.batch_invariant() runs a delta rule token by token (the order the "
            "generator's decode uses), and this layer's module has no token-by-token rule "
            "beside its chunked one; run it outside batch_invariant()"
        )
    return _token_by_token(recurrent)


def _token_by_token(recurrent: Callable) -> Callable:
    """``recurrent`` (no ``chunk_size``) called as the chunked reference is."""
    return lambda *tensors, chunk_size=None, **kwargs: recurrent(*tensors, **kwargs)


def _start_state(plan, p: int, states: dict, initial_state: torch.Tensor | None) -> torch.Tensor | None:
    piece = plan.pieces[p]
    if piece.parent >= 0:
        return states[piece.parent]
    return None if initial_state is None else initial_state[piece.seq]


def _initial(initial_state, seq: int, value: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    if initial_state is not None:
        return initial_state[seq]
    return value.new_zeros(value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)


def _run_group(reference, fla, tensors, plan, group, init, chunk_size, common):
    """Run pieces ``group`` from states ``init`` (None: zero); returns their outputs (their
    rows' values, flat), their final states and the rows."""
    pieces = [plan.pieces[p] for p in group]
    lengths = [len(piece) for piece in pieces]
    value = tensors[2]
    rows = np.concatenate([np.arange(piece.start, piece.end) for piece in pieces])
    if max(lengths) == 1 and fla is None:  # one token each (decode): a batch of length-1 rows, no padding
        if np.array_equal(rows, np.arange(value.shape[1])):
            batch = [t.transpose(0, 1) for t in tensors]
        else:
            index = torch.from_numpy(rows).to(value.device)
            batch = [t[0, index][:, None] for t in tensors]
        out, final = reference(*batch, chunk_size=chunk_size, initial_state=init, output_final_state=True, **common)
        return out[:, 0], final, rows
    if fla is not None:
        index = torch.from_numpy(rows).to(value.device)
        cu = torch.from_numpy(np.concatenate(([0], np.cumsum(lengths)))).to(value.device)
        gathered = [t[:, index] for t in tensors]
        out, final = fla(*gathered, initial_state=init, output_final_state=True, cu_seqlens=cu, **common)
        return out[0], final, rows
    width = max(lengths)
    total = value.shape[1]
    padded = np.full((len(pieces), width), total, dtype=np.int64)  # row `total`: the zero row
    for i, piece in enumerate(pieces):
        padded[i, : len(piece)] = np.arange(piece.start, piece.end)
    index = torch.from_numpy(padded).to(value.device)
    batch = [torch.cat([t[0], t.new_zeros((1,) + t.shape[2:])])[index] for t in tensors]
    out, final = reference(*batch, chunk_size=chunk_size, initial_state=init, output_final_state=True, **common)
    valid = torch.from_numpy(np.arange(width)[None, :] < np.asarray(lengths)[:, None]).to(value.device)
    return out[valid], final, rows


def _run_own(tensors, plan, group, init, chunk_size, common):
    """Run pieces ``group`` through nopad's own chunked gated delta rule, all at once; returns
    what :func:`_run_group` does."""
    pieces = [plan.pieces[p] for p in group]
    starts, lengths = [piece.start for piece in pieces], [len(piece) for piece in pieces]
    out, final = chunked_delta_rule.chunked_gated_delta_rule(
        *tensors, starts, lengths, initial_state=init, chunk_size=chunk_size, **common
    )
    return out, final, piece_rows(starts, lengths)


def _zero_state(tensors) -> torch.Tensor:
    key, value = tensors[1], tensors[2]
    return value.new_zeros(value.shape[2], key.shape[-1], value.shape[-1], dtype=torch.float32)
