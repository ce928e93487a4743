"""The generator's hold on the live HF model it borrows (no copy of the weights).

What it checks when the generator is built (a layer whose state the paged cache cannot hold, the
dtype, the attention backend, static decode), the dtype attention computes in (the KV cache's),
how a step runs on the model (nopad's paged attention in eval mode, switched once for a whole
run; autocast when ``dtype=`` differs from the weights), and the KV cache and model runner, built
at the first step after a release.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from nopad.inference.kv_cache import KVCache, kv_layout, num_kv_blocks
from nopad.inference.model_runner import ModelRunner, check_static_decode_backend
from nopad.inference.state_cache import StateCache, StateSlots, bytes_per_slot, layer_states
from nopad.packing.attention import names as attention_backends
from nopad.packing.attention import paged_block_size
from nopad.packing.distributed import compute_dtype as model_compute_dtype
from nopad.packing.hf import NOPAD_ATTENTION, register_nopad_attention, use_nopad_attention
from nopad.packing.mixers import GENERATE, check_model
from nopad.packing.model_config import text_config

logger = logging.getLogger(__name__)


class LiveModel:
    """The :class:`nopad.inference.Generator`'s arguments about the model, applied.

    Precision and attention: the KV cache is kept in the compute dtype of attention - ``dtype``
    if given (steps then run under ``torch.autocast`` in it when the weights are another dtype),
    else the autocast dtype when the first step runs under ``torch.autocast``, else the weights'
    dtype - so bf16 autocast over fp32 weights caches bf16 K/V, as the layers produce them.
    ``attn_backend`` (default: the ``NOPAD_ATTN_BACKEND`` environment variable, else
    :func:`nopad.packing.attention.choose_backend`'s rule) picks the attention backend of every step.
    ``block_size`` defaults to what the attention backend reads in place
    (:func:`nopad.packing.attention.paged_block_size`: 256 for flash-attn 2 and torch's varlen kernel,
    else 16); smaller blocks would make every layer gather the context.

    ``static_decode=True`` pads pure decode steps to bucketed shapes (sequences rounded up to 2,
    4, 8 or a multiple of 8, block-table width to a power of two, at least 2; padding rows write to
    one extra scratch block) and runs their attention on fixed shapes, so the step can be captured;
    ``compile_decode=True`` also compiles that forward, once, with the rows and table width
    dynamic (``torch.compile``; ``mode="reduce-overhead"`` on CUDA, one CUDA graph per bucket; the
    attention kernel is one custom op). Prefill steps and batch-invariant mode keep the default
    path. On hybrid models the step also names each row's state slot as a device tensor (padding
    rows: one scratch slot), and the conv, delta-rule and Mamba2 decode steps read and write the
    slots in place (:mod:`nopad.inference.state_cache`), so the same one compilation serves them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        dtype: torch.dtype | None,
        attn_backend: str | None,
        static_decode: bool,
        compile_decode: bool,
    ):
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"dtype must be a floating torch.dtype (torch.bfloat16, ...), got {dtype!r}")
        if attn_backend is not None and attn_backend not in attention_backends():
            raise ValueError(f"unknown attn_backend {attn_backend!r}; choose one of {attention_backends()}")
        if (static_decode or compile_decode) and attn_backend not in (None, "auto"):
            check_static_decode_backend(attn_backend)
        check_model(model, GENERATE)  # a layer whose per-sequence state the paged cache cannot hold
        self.layer_states = layer_states(model)  # hybrid layers' per-sequence state (empty: attention only)
        self.model = model
        self.text_config = text_config(model.config)  # the language model's (multimodal classes)
        self.kv_layout = kv_layout(model.config, model)  # each layer's K/V heads, as its module computes
        # FSDP2: the compute dtype of its mixed-precision policy, not the shard's storage dtype
        self.device, self.weight_dtype, self.requested_dtype = (
            next(model.parameters()).device,
            model_compute_dtype(model),
            dtype,
        )
        self.attn_backend = attn_backend
        self.static_decode, self.compile_decode = static_decode or compile_decode, compile_decode
        self.dtype = self.compute_dtype()
        self._attention_held = False
        self._switch = AttentionSwitch(model)

    def compute_dtype(self) -> torch.dtype:
        """The dtype attention computes in now: ``dtype=``, else the autocast dtype, else the
        weights' dtype (what :func:`nopad.packing.distributed.compute_dtype` casts q/k/v to)."""
        if self.requested_dtype is not None:
            return self.requested_dtype
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return self.weight_dtype

    def state_bytes(self, slots: int) -> int:
        """Bytes of the hybrid layers' state for ``slots`` slots, and static decode's scratch slot
        (its padding rows write it), out of the generator's memory budget."""
        return (slots + int(self.static_decode)) * bytes_per_slot(self.layer_states, self.dtype)

    def num_kv_blocks(
        self,
        block_size: int,
        num_blocks: int | None,
        kv_memory_bytes: int | None,
        max_num_seqs: int,
        snapshots: int,
        max_model_len: int,
    ) -> int:
        """The KV cache's blocks for this model (:func:`nopad.inference.kv_cache.num_kv_blocks`), after
        the state of ``max_num_seqs`` sequences and ``snapshots`` prefix snapshots (hybrid models)."""
        state_bytes = self.state_bytes(max_num_seqs + snapshots)
        return num_kv_blocks(
            self.kv_layout,
            block_size,
            self.dtype,
            num_blocks,
            kv_memory_bytes,
            max_num_seqs,
            state_bytes,
            max_model_len,
        )

    def default_block_size(self) -> int:
        """The block size the attention backend reads in place. Decided for half precision: fp32
        weights may run their steps under autocast, which is only known when a step runs."""
        half = self.dtype if self.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        try:
            return paged_block_size(self.device, half, self.attn_backend)
        except ValueError:
            if half == self.dtype:
                raise
            # no backend for half precision here (the Triton set on CPU): decide for the model's own
            # dtype, so that a refusal names the dtype the user has, not bf16
            return paged_block_size(self.device, self.dtype, self.attn_backend)

    def build_runner(
        self, num_blocks: int, block_size: int, state_slots: StateSlots | None, max_num_seqs: int, max_model_len: int
    ) -> ModelRunner:
        """A KV cache of ``num_blocks`` (one more with static decode: the padding rows' scratch
        block, and a scratch state slot on hybrid models) in the compute dtype of now, and the
        runner of steps on it (``runner.kv_cache``)."""
        self.dtype = self.compute_dtype()  # autocast may be on now and not at construction
        # hybrid layers' state: the kernel calls of a step find it on the cache they are given
        states = (
            StateCache(self.layer_states, state_slots, self.dtype, self.device, scratch=self.static_decode)
            if self.layer_states
            else None
        )
        kv_cache = KVCache(
            self.kv_layout, num_blocks + int(self.static_decode), block_size, self.dtype, self.device, states=states
        )
        return ModelRunner(
            self.model,
            kv_cache,
            backend=self.attn_backend,
            static_decode=self.static_decode,
            compile_decode=self.compile_decode,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=math.ceil(min(max_model_len, 1 << 40) / block_size),
            scratch_block=num_blocks if self.static_decode else None,
        )

    @contextlib.contextmanager
    def attention(self) -> Iterator[None]:
        """nopad's paged attention, eval mode and the forward guard (``use_nopad_attention``),
        restored on exit, also on error. Re-entered while held (a run's steps), it does nothing:
        switching costs ``eval()``/``train()`` and a hook, too much for every step. A bare ``step()``
        switches for itself, so the user's code between steps sees the model as it was; the configs
        are switched first, through :class:`AttentionSwitch` (``use_nopad_attention`` then finds them
        switched), since ``set_attn_implementation`` walks every module, twice a step."""
        if self._attention_held:
            yield
            return
        previous = self.model.config._attn_implementation
        if previous != NOPAD_ATTENTION:
            self._switch(NOPAD_ATTENTION)
        try:
            with use_nopad_attention(self.model, eval_mode=True, context=GENERATE):
                self._attention_held = True
                try:
                    yield
                finally:
                    self._attention_held = False
        finally:
            if self.model.config._attn_implementation != previous:
                self._switch(previous)

    def autocast(self) -> contextlib.AbstractContextManager:
        """``dtype=`` other than the weights' (e.g. bf16 rollouts of an fp32 policy): run the step
        under autocast in that dtype, as mixed-precision training runs the same layers."""
        dtype = self.requested_dtype
        if dtype is None or dtype == self.weight_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)


class AttentionSwitch:
    """``model.set_attn_implementation(name)`` without its module walk after the first time.

    transformers walks every module to find the sub-models' configs (~100 Python calls per layer),
    and what a switch leaves in them depends only on the name and on the configs the model has. The
    generator's model keeps its modules while the generator serves it (its KV cache is laid out by
    them), so the configs a first switch to each name leaves are recorded and later switches set
    them again: the same state, in a few calls."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._done: dict[str | None, tuple] = {}

    def __call__(self, name: str | None) -> None:
        done = self._done.get(name)
        if done is None:
            register_nopad_attention()  # transformers refuses "nopad" unregistered; idempotent
            self.model.set_attn_implementation(name)
            self._done[name] = tuple(
                (config, config._attn_implementation_internal) for config in attention_configs(self.model)
            )
            return
        for config, value in done:
            config._attn_implementation_internal = value


def attention_configs(model: torch.nn.Module) -> list:
    """Every config ``set_attn_implementation`` may switch: the model's, its sub-configs at any
    depth, and those of the sub-models among its modules."""
    found: dict[int, object] = {}
    pending = [model.config, *(m.config for m in model.modules() if isinstance(m, PreTrainedModel))]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending += [sub for key in config.sub_configs if (sub := getattr(config, key, None)) is not None]
    return list(found.values())
