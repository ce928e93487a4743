"""The work of an eager hybrid decode step per stateful layer, counted (not timed: noise-free).

A decode step reads and rewrites every sequence's recurrent state in every stateful layer, and
those states are most of the step's memory traffic (a Bamba-shaped layer at 12 rows: 1.5 MB, read
and written per pass, where its token's activations are kB). The Mamba2 step made 9 passes over the
states (transformers' ``mamba2_selective_state_update`` broadcasts the decay's ``exp`` and
``dt B`` over the state before using them, then the generator's clone and copy-back) and now makes
3; the gated delta rule allocated 5 state-sized tensors a layer and now 1, on 5 passes (the ops of
transformers' token-by-token rule, in place). Bringing either back raises the counts here. The
Python calls of each hybrid kernel call of the step are counted too, as
``tests/inference/test_inference_step_syncs.py`` counts the attention's.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.bench_decode_host import VIEW_OPS, gc_held
from nopad.inference import Generator, SamplingParams
from tests.inference.test_inference_hybrid import hybrid_model

ALLOCATING = {"empty", "empty_like", "empty_strided"}  # a buffer, no pass over it
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# per stateful layer of a decode step: (passes over the states, state-sized tensors allocated)
STATE_BUDGET = {"qwen3_5": (5, 1), "bamba": (3, 1), "nemotron_h": (3, 1)}
# Python calls of one kernel call of a decode step (the call made through nopad's dispatch); at this
# commit conv 16 to 19, gated delta rule 34, Mamba2 scan 20
CALL_BUDGET = {"causal_conv1d_fn": 22, "torch_chunk_gated_delta_rule": 38, "mamba2_chunk_scan": 24}
MODULES = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "bamba": "transformers.models.bamba.modeling_bamba",
}

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


class StatePasses(TorchDispatchMode):
    """Aten ops whose output has ``numel`` elements (the step's recurrent states of one layer):
    the passes over the states (an op computing them) and the allocations (a new tensor: an op
    neither in place nor ``out=``, or an empty buffer)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.passes, self.allocated = numel, Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        name = func.overloadpacket.__name__
        if isinstance(first, torch.Tensor) and first.numel() == self.numel and name not in VIEW_OPS:
            if name not in ALLOCATING:
                self.passes[name] += 1
            if name in ALLOCATING or not (name.endswith("_") or func._overloadname == "out"):
                self.allocated[name] += 1
        return out


def decoding(family: str) -> Generator:
    """A generator of a tiny ``family`` model, three sequences past their prefill, decoding."""
    gen = Generator(hybrid_model(family), block_size=4, max_num_batched_tokens=64, max_num_seqs=4)
    for prompt in ([5, 6, 7], [8, 9, 10, 11], [12, 13]):
        gen.add_request(prompt, GREEDY)
    gen.step()  # prefill
    gen.step()
    return gen


@pytest.mark.parametrize("family", sorted(STATE_BUDGET))
def test_a_decode_step_passes_over_the_states_a_few_times_per_layer(family):
    """Ops writing a state-sized tensor in one decode step, per stateful layer: at most the
    recurrence's own passes (Mamba2 3, was 9; gated delta rule 5, was 6) and one allocation (was
    7 and 5); a broadcast, a clone or a copy back coming back fails here."""
    gen = decoding(family)
    states = gen._kv_cache.states.named["recurrent"]
    layers = len(states)
    mode = StatePasses(3 * states[0][0].numel())  # three sequences decoding
    with gen.live.attention(), mode:
        gen.step()
    passes, allocated = STATE_BUDGET[family]
    assert sum(mode.passes.values()) <= passes * layers, f"{layers} layers: {dict(mode.passes)}"
    assert sum(mode.allocated.values()) <= allocated * layers, f"{layers} layers: {dict(mode.allocated)}"


@pytest.mark.parametrize("family", sorted(MODULES))
def test_hybrid_kernel_calls_of_a_decode_step_make_few_python_calls(family, monkeypatch):
    """The host work of each hybrid kernel call of a decode step (nopad's dispatch, its state
    step, the recurrence), in Python calls: per-layer plan building, metadata rebuilding or
    generators resumed per tensor coming back raise the count past the budget."""
    gen = decoding(family)
    module = importlib.import_module(MODULES[family])
    per_call: dict[str, list[int]] = {}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls = [0]

            def profile(frame, event, arg):
                calls[0] += event == "call"

            sys.setprofile(profile)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
                per_call.setdefault(name, []).append(calls[0])

        return call

    for name in CALL_BUDGET:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, counted(name, getattr(module, name)))
    with gen.live.attention(), gc_held():
        gen.step()
    assert per_call
    for name, calls in per_call.items():
        assert max(calls) <= CALL_BUDGET[name], f"{name}: {calls} Python calls, over {CALL_BUDGET[name]}"
