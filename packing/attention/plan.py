"""The attention plan: a forward's backend decisions, made once and read by every layer.

What the choice of backend depends on besides the layer - ``NOPAD_ATTN_BACKEND`` and whether
:func:`nopad.packing.batch_invariant` is on (and its kernel set) - is read when the plan is made, at the
start of a forward: transformers calls nopad's mask hook once per forward (per mask kind) and hands
its result to every layer as ``attention_mask`` (:mod:`nopad.packing.hf.attention`), so a generator
step and a training forward each make one plan. A layer asks the plan for the backend of its call
(device, dtype, window, softcap, paged or not, ...); the answer for a call like it is computed at
first use and reused, so :func:`registry.choose` runs once per kind of layer in a forward, not
once per layer (``benchmarks/bench_attention_plan.py`` counts and times it). The plan also keeps
what else the layers of a forward share - the resolved meta, whether the model was checked - so a
decode step's per-layer host work stays a few look-ups (``benchmarks/bench_decode_host.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from nopad.packing import invariance
from nopad.packing.attention.registry import (
    BACKEND_ENV,
    Backend,
    Call,
    choose,
    choose_differentiable,
    requested_backend,
)
from nopad.packing.varlen import VarlenMeta


@dataclass
class PlannedRow:
    """The forward's row as its layers read it, resolved by the first layer: the caller's
    ``nopad_meta`` / ``position_ids`` (kept by identity) and the layer's shape give ``meta`` (derived
    from the positions, moved to the query's device and checked against the positions once)."""

    nopad_meta: VarlenMeta | None
    position_ids: torch.Tensor | None
    shape: tuple  # (batch, q_len, k_len, device)
    meta: VarlenMeta

    def matches(self, nopad_meta, position_ids, shape: tuple) -> bool:
        return self.nopad_meta is nopad_meta and self.position_ids is position_ids and self.shape == shape


class Decision(NamedTuple):
    """A layer's backend and the call it was chosen for (whose flags say how the keys are read)."""

    call: Call  # the call as the registry saw it (with the plan's mode)
    backend: Backend


_MASK_READ = (
    "the model uses its attention mask itself, besides handing it to the attention interface: "
    "under nopad attention the mask is nopad's plan (no dense mask: a packed row's boundaries are "
    "in nopad_meta), so this model's own masking cannot run on nopad; keep it unpacked (sdpa), or "
    "see docs/models.md"
)


class AttentionPlan:
    """The backend decisions of one forward (see module docstring). ``backend`` is the default
    request (``"auto"``: ``NOPAD_ATTN_BACKEND``, else the registry's rule)."""

    def __init__(self, backend: str | None = None):
        self.env_backend = os.environ.get(BACKEND_ENV) or None  # read once, here
        self.default = backend or "auto"
        self.invariant = invariance.is_enabled()
        self.kernels = invariance.active_kernels()
        self.decisions = 0  # runs of registry.choose this plan made (the benchmark and tests read it)
        self.row: PlannedRow | None = None  # set by the first layer (nopad.packing.hf.attention)
        self.checked: set[str] = set()  # contexts the forward's model was checked for (nopad.packing.mixers)
        self.cache_layers: set[int] = set()  # layers that took their paged K/V in this forward
        self._decided: dict[tuple, Decision] = {}
        self._differentiable: dict[tuple, Backend] = {}

    def __getitem__(self, index) -> AttentionPlan:
        """The plan itself: transformers slices a dense mask to the kept query rows before K/V-shared
        layers (Gemma4's ``_maybe_slice_kv_shared_inputs``). A plan holds no mask - each layer
        resolves its boundaries from ``nopad_meta`` or its own query and key lengths - so a row cut
        that way gets the same plan, and a ``nopad_meta`` that no longer matches the row is refused
        by the layer (:func:`nopad.packing.hf.attention.nopad_attention`)."""
        return self

    def __getattr__(self, name: str):
        """Only for names a plan lacks: a model that reads its attention mask as a tensor itself
        (Doge's dynamic mask reads ``.dtype``) masks tokens outside the attention interface, where
        nopad gives it no dense mask. Say so, not just "no attribute"."""
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{_MASK_READ} (it asked for .{name})")

    def __add__(self, other):
        raise TypeError(f"{_MASK_READ} (it added to it)")

    __radd__ = __add__

    def decide(
        self,
        device: torch.device,
        dtype: torch.dtype,
        softcap: float | None = None,
        window: int | None = None,
        *,
        paged: bool = False,
        block_size: int = 1,
        shared_prefix: bool = False,
        grad: bool = False,
        static: bool = False,
        override: str | None = None,
        sinks: bool = False,
    ) -> Decision:
        """The backend for a layer's call (``override``: the layer's ``backend=``, else the
        plan's). A layer like one seen before in this forward is a dictionary look-up."""
        key = (device, dtype, softcap, window, paged, block_size, shared_prefix, grad, static, override, sinks)
        decision = self._decided.get(key)
        if decision is None:
            call = Call(
                device,
                dtype,
                softcap,
                window,
                paged,
                block_size,
                shared_prefix,
                grad,
                static,
                invariant=self.invariant,
                kernels=self.kernels,
                sinks=sinks,
            )
            requested = requested_backend(
                override if override not in (None, "auto") else self.default, self.env_backend
            )
            decision = self._decided[key] = Decision(call, choose(call, requested))
            self.decisions += 1
        return decision

    def differentiable(
        self, device: torch.device, dtype: torch.dtype, softcap: float | None, window: int | None, sinks: bool = False
    ) -> Backend:
        """The backend a forward-only kernel's backward recomputes such a layer with."""
        key = (device, dtype, softcap, window, sinks)
        backend = self._differentiable.get(key)
        if backend is None:
            backend = self._differentiable[key] = choose_differentiable(
                Call(device, dtype, softcap, window, grad=True, sinks=sinks)
            )
        return backend


def choose_backend(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    override: str | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    paged: bool = False,
    block_size: int = 1,
    shared_prefix: bool = False,
    grad: bool = False,
) -> str:
    """The name of the backend that runs attention for a call like this now (logged once per decision).

    ``"auto"`` (the default, unless ``override=`` / ``NOPAD_ATTN_BACKEND`` names one):

    - CUDA, training rows and shared-prefix rows: flash-attn 2/3 when installed and able; else
      PyTorch's own FlashAttention varlen (``torch_varlen``, when this torch has it and the layer
      fits: no softcap); else FlexAttention for what needs a score mod (softcap); else per-sequence
      SDPA, with a one-time warning saying what to install. fp32 runs exact SDPA (the flash kernels
      are fp16/bf16 only), with advice to train under bf16 autocast.
    - CUDA, paged generation steps: a backend that reads the blocks in place - flash-attn's
      ``block_table``, then ``torch_varlen(block_table=)`` (both need blocks of 256), then nopad's
      Triton kernel (any block size); else the training rule on gathered keys.
    - CPU: the compiled kernel for paged steps (keys read in place), per-sequence SDPA for training
      rows (faster forward+backward than the kernel, whose backward recomputes with SDPA).
    - Inside :func:`nopad.packing.batch_invariant`: only backends declared ``invariant`` (a fixed
      per-query order) - the compiled CPU kernel (or its pure-PyTorch twin ``per_token``) on CPU,
      the Triton kernel on CUDA.

    A named backend runs wherever it is asked to (for debugging and the tests' stand-ins); one that
    cannot serve the call is an error, except flash-attn on fp32, which runs exact SDPA with advice.
    """
    decision = AttentionPlan(override).decide(
        torch.device(device),
        dtype,
        softcap or None,
        sliding_window,
        paged=paged,
        block_size=block_size,
        shared_prefix=shared_prefix,
        grad=grad,
    )
    return decision.backend.name


def paged_block_size(device: torch.device | str, dtype: torch.dtype, override: str | None = None) -> int:
    """The KV block size a generator should allocate: 256 when the backend that would run its steps
    reads only such pages in place (flash-attn 2 and torch's varlen kernel), else 16."""
    backend = AttentionPlan(override).decide(torch.device(device), dtype, paged=True, block_size=256).backend
    if backend.reads_pages is not None and backend.reads_pages(256) and not backend.reads_pages(16):
        return 256
    return 16
