"""The generator's per-sequence state beside its KV blocks: one slot per running sequence in every
state tensor a stateful layer declares (Gated DeltaNet, KDA, short convolutions, Mamba2: a conv
state and a recurrent one; any kind registered with a ``state``).

Why slots, not blocks. An attention layer's context is its K/V, one entry per token, so it pages.
A hybrid layer's context is a fixed-size state (the last ``K - 1`` conv inputs, a ``(heads, K, V)``
delta-rule matrix, a Mamba2 ``(heads, head_dim, state)`` SSM state) that the next token reads
whole and overwrites: it belongs to the sequence, not to its tokens. So a sequence holds one slot
(:class:`StateSlots`, pure bookkeeping next to the block allocator) while it holds blocks, and the
tensors (:class:`StateCache`) live beside the K/V, sized from the model's modules and paid for out
of the same memory budget.

What a slot holds. Each stateful mixer kind declares its per-sequence tensors (names, shapes,
dtypes: :mod:`nopad.packing.mixers.state`) through the :class:`~nopad.packing.mixers.MixerSupport` it
registers; :func:`layer_states` asks the registry, so this module names no mixer, and a new kind
is one module (its support, its state, its step). The cache zeroes, copies and snapshots a slot
tensor by tensor, whole.

How a step reaches the state. The layers mix tokens in kernel functions that nopad wraps
(:mod:`nopad.packing.mixers.hf_kernels`, :mod:`nopad.packing.mixers.mamba2`) or in a mixer's own
forward. A generator step calls the model with ``nopad_kv_cache`` (the attention layers' paged K/V);
that cache carries this state cache as ``.states``, and every kernel call of the step reaches it
through the same keyword - no new argument that the attention function would have to know - and
calls :meth:`StateCache.run` with the name of the tensor it continues. Within one forward the
stateful layers run in model order and each makes at most one call per tensor it declares, so the
i-th call naming ``conv`` is the i-th layer declaring a ``conv``; each call checks its state's
shape, and :meth:`StateCache.end` the number of calls, so a model that breaks that order fails
loudly. Why call order and not the layer's identity: the call is made by the model's own code
(transformers' ``causal_conv1d_fn(hidden_states, weight, ...)``, ``chunk_gated_delta_rule(q, k,
v, g, beta, ...)``, ``mamba2_chunk_scan(...)``) with the decoder's shared ``**kwargs`` - the same
dict for every layer - and tensors computed in the forward (``conv1d.weight.squeeze(1)``,
``-exp(A_log)``), so nothing the kernel receives names its layer; naming it would take a forward
hook on every stateful module writing the current layer into this cache, a Python side effect
inside the compiled, CUDA-graphed decode step. Each call starts every sequence of the row from
its slot (zero for a sequence's first chunk) and writes back its final state: a decode step and a
chunked prefill are the same call.

Lifetime (the scheduler): a slot is taken at admission and freed with the blocks (finish,
preemption: the state is then recomputed from the tokens); a paused tool episode keeps it; a
fork's members get fresh slots holding copies of the parent's final state, copied before the next
forward (a member finding none free is preempted and recomputes). Cross-request prefix reuse
goes through state snapshots at block boundaries (:mod:`nopad.inference.state_prefix`): their slots are
further rows of the same tensors, after the sequences' slots.

Static decode (``static_decode`` / ``compile_decode``). A padded decode step names its rows' slots
as one ``(rows,)`` device tensor, padding rows pointing at a scratch slot (one more row, after the
snapshots', as the KV cache pads with a scratch block), and every kernel call reads and writes
the slots through it: no host number depends on the batch, so one compiled (or CUDA-graph)
forward serves every step of a bucket. Fork copies and fresh zeros run before that forward.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nopad.packing.mixers.state import LayerState, bytes_per_slot
from nopad.packing.mixers.support import GENERATE, registered_supports
from nopad.packing.varlen import VarlenMeta

__all__ = ["LayerState", "StateCache", "StateSlots", "bytes_per_slot", "copy_waves", "layer_states"]


def layer_states(model: nn.Module) -> list[LayerState]:
    """Every stateful mixer of ``model`` in forward order, as the registered supports declare them
    (an empty list: attention only). A module inside one already found is part of it."""
    declare = [s.state for s in registered_supports() if s.state is not None and GENERATE in s.contexts]
    states: list[LayerState] = []
    for path, module in model.named_modules():
        if any(path.startswith(s.path + ".") for s in states):
            continue
        state = next((found for fn in declare if (found := fn(module, path)) is not None), None)
        if state is not None:
            states.append(state)
    return states


class StateSlots:
    """Which state slot each live sequence holds (bookkeeping only, like the block allocator),
    and the copies a fork asked for, done before the next forward."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        # a min-heap: the lowest free slot first, so sequences admitted together hold consecutive slots and
        # a step reads and writes their states as one slice, not a gather and a scatter of every layer's
        # state (a slot released at the back of a FIFO had made nearly every step gather: 11-15% of an
        # eager hybrid decode step at 12 rows, measured on Qwen3.5 and Bamba)
        self._free: list[int] = list(range(num_slots))
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) rows, applied in this order
        self.snapshots = None  # nopad.inference.state_prefix.StateSnapshots: the prefix cache's states

    @property
    def num_rows(self) -> int:
        """Rows of the state tensors: the sequences' slots, then the snapshots'."""
        return self.num_slots + (self.snapshots.capacity if self.snapshots is not None else 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} state slots are taken")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not held")
        self.pending_copies = [(s, d) for s, d in self.pending_copies if d != slot]
        heapq.heappush(self._free, slot)

    def copy(self, src: int, dst: int) -> None:
        """``dst`` starts from ``src``'s state as it is after this step (a fork, a snapshot)."""
        self.pending_copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies


def copy_waves(copies: list[tuple[int, int]]) -> list[tuple[list[int], list[int]]]:
    """``(src, dst)`` copies in order as few batched copies (``t[dst] = t[src]`` reads every
    source first): a new batch starts where a copy reads or rewrites a row the batch writes."""
    waves: list[tuple[list[int], list[int]]] = []
    for src, dst in copies:
        if not waves or src in waves[-1][1] or dst in waves[-1][1]:
            waves.append(([], []))
        waves[-1][0].append(src)
        waves[-1][1].append(dst)
    return waves


@dataclass
class _Step:
    index: torch.Tensor | slice  # the slot of each sequence of the row (a slice: consecutive slots)
    meta: VarlenMeta  # the row's new tokens only: their context is in the slots (static: one each)
    calls: dict


class StateCache:
    """``(num_rows, *shape)`` tensors for every state tensor a stateful layer declares (``named``:
    by name, in model order), and the step in flight."""

    def __init__(
        self, states: list[LayerState], slots: StateSlots, dtype: torch.dtype, device, *, scratch: bool = False
    ):
        n = slots.num_rows + int(scratch)
        self.slots = slots
        self.scratch_slot = slots.num_rows if scratch else None  # static decode's padding rows
        self.named: dict[str, list[torch.Tensor]] = {}
        for state in states:
            for spec in state.tensors:
                tensor = torch.zeros((n, *spec.shape), dtype=spec.dtype or dtype, device=device)
                self.named.setdefault(spec.name, []).append(tensor)
        self.tensors = [t for tensors in self.named.values() for t in tensors]
        self.device = torch.device(device)
        self._step: _Step | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def begin(self, slots: list[int], fresh: list[int], seqlens: list[int]) -> None:
        """Open a step over sequences holding ``slots`` (row order) that bring ``seqlens`` new
        tokens; ``fresh`` slots start from zero (a sequence's first chunk). Fork copies first."""
        self._prepare(fresh)
        index: torch.Tensor | slice = torch.tensor(slots, dtype=torch.long, device=self.device)
        if slots and slots == list(range(slots[0], slots[0] + len(slots))):  # a copy, not a gather/scatter
            index = slice(slots[0], slots[0] + len(slots))
        meta = VarlenMeta.from_lengths(seqlens, device=self.device)
        self._step = _Step(index, meta, dict.fromkeys(self.named, 0))

    def begin_static(self, index: torch.Tensor, fresh: list[int], meta: VarlenMeta) -> None:
        """Open a static decode step: ``index`` ``(rows,)`` holds each row's slot on the device
        (padding rows: :attr:`scratch_slot`), ``meta`` is the step's static meta (one token a row)."""
        if self.scratch_slot is None:
            raise ValueError("a static decode step needs the state cache built with scratch=True")
        self._prepare(fresh)
        self._step = _Step(index, meta, dict.fromkeys(self.named, 0))

    def _prepare(self, fresh: list[int]) -> None:
        """Fork copies, then zeros for ``fresh`` slots: before the step's forward, outside it."""
        waves = [
            (torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))
            for src, dst in copy_waves(self.slots.take_copies())
        ]
        zero = torch.tensor(fresh, device=self.device) if fresh else None
        for t in self.tensors:
            for src, dst in waves:
                t[dst] = t[src]
            if zero is not None:
                t[zero] = 0

    def end(self) -> None:
        """Close the step; every stateful layer must have run exactly once."""
        step, self._step = self._step, None
        if step is None:
            return
        want = {name: len(tensors) for name, tensors in self.named.items()}
        if step.calls != want:
            raise RuntimeError(
                f"a generator step made {step.calls} stateful kernel calls, the model has "
                f"{want} stateful layers; nopad cannot tell which state each call is"
            )

    def abandon(self) -> None:
        """Forget the step in flight (its forward raised)."""
        self._step = None

    def run(
        self, kind: str, fn: Callable[[VarlenMeta, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """One kernel call of the step on the state tensor named ``kind``: ``fn(meta,
        initial_states)`` runs the row from each sequence's slot and returns ``(output,
        final_states)``; the finals go back to the slots. ``fn`` may update ``initial_states`` in
        place and return it as the finals: on consecutive slots it is a view of the slots, so
        nothing is copied back (a decode step's states are most of its memory traffic)."""
        step = self._step
        if step is None:
            raise RuntimeError("a stateful kernel ran outside a generator step")
        if kind not in self.named:
            raise RuntimeError(
                f"a kernel call of the step asks for a {kind!r} state, which no stateful layer "
                f"of the model declares (declared: {sorted(self.named)})"
            )
        tensors = self.named[kind]
        i = step.calls[kind]
        step.calls[kind] += 1
        if i >= len(tensors):
            raise RuntimeError(
                f"more {kind} kernel calls in one step than the {len(tensors)} stateful layers nopad sized"
            )
        store = tensors[i]
        # consecutive slots pass a view, no copy: only this step's sequences own those rows
        view = isinstance(step.index, slice)
        initial = store[step.index] if view else store.index_select(0, step.index)
        out, final = fn(step.meta, initial)
        if final.shape != initial.shape:
            raise RuntimeError(
                f"{kind} call {i} returned a state of shape {tuple(final.shape)}; its slots hold {tuple(initial.shape)}"
            )
        if final is not initial or not view:  # else updated in place, in the slots already
            store[step.index] = final.to(store.dtype)
        return out
