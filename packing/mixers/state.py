"""What a stateful mixer keeps per sequence in the generator, declared by the mixer's own module
(as vLLM v1's ``MambaSpec`` declares a Mamba layer's state).

Why declared. An attention layer's context pages (one K/V entry per token); a stateful layer's is
a fixed-size state per sequence that the next token reads whole and overwrites. The generator
(:mod:`nopad.inference.state_cache`) holds those states in slots, one row per sequence, but it must
not know the mixers: each kind says what it keeps - named tensors, their shape per sequence and
their dtype (:class:`StateSpec`) - through the ``state`` of the :class:`MixerSupport` it registers
(:func:`nopad.inference.state_cache.layer_states` asks the registry). The generator then sizes,
zeroes, copies (forks) and snapshots (prefix cache) those rows without reading any further: a
slot's tensors are copied whole, so a fork or a snapshot is a row copy, and a sequence's first
step starts from zeros.

How a step reaches the state. The mixer's step calls ``step_states(kwargs).run(name, fn)`` with
``fn(meta, initial) -> (output, final)``; the ``i``-th call naming ``name`` in a forward is the
``i``-th layer, in model order, that declares a tensor ``name`` (see
:mod:`nopad.inference.state_cache` for why call order, not the layer's identity). A new stateful
kind is one module: its :class:`MixerSupport` (with ``state``), its packed-row and step code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateSpec:
    """One named per-sequence tensor of a stateful layer: ``shape`` per sequence (its slot's row)
    and ``dtype`` (None: the dtype the model computes in, e.g. a conv's last inputs)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's tensor (``dtype``: the model's, where the spec names none)."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype or dtype).element_size()


@dataclass(frozen=True)
class LayerState:
    """The state one stateful mixer (at ``path`` in the model) keeps per sequence."""

    path: str
    tensors: tuple[StateSpec, ...]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The per-sequence shape of the tensor ``name`` (None: this layer keeps none)."""
        return next((s.shape for s in self.tensors if s.name == name), None)


def bytes_per_slot(states: list[LayerState], dtype: torch.dtype) -> int:
    """Bytes one sequence's slot takes in every stateful layer (``dtype``: the model's)."""
    return sum(spec.nbytes(dtype) for state in states for spec in state.tensors)


def step_states(kwargs: dict):
    """The generator's per-sequence state cache of this call (a forward's ``**kwargs``), if it is a
    generator step: its ``nopad_kv_cache`` carries it as ``.states``."""
    return getattr(kwargs.get("nopad_kv_cache"), "states", None)
