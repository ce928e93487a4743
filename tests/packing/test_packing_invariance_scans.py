"""Batch-invariant mode at the level of the hybrid layers' kernel functions: the trainer's packed
row (the call with ``nopad_meta`` only) equals the generator's one-token decode steps over the same
sequences (the call whose ``nopad_kv_cache`` carries the per-sequence state slots), bitwise, in fp32
and bf16 - for the gated delta rule, the Mamba2 scan and the causal convolution.

Why here and not only at the model level: in a bf16 model the layer's output is rounded to bf16
and passed through norms and projections, which swallow a scan run in another order, so a trainer
that left the mode's order went unnoticed in bf16. The functions are called as the layers call them
(transformers' module globals, rebound by nopad), so this is the seam the model goes through. The
inputs keep the recurrent term large: slow decay (the state holds a long history) and, for Mamba2,
a skip ``D x`` small beside ``C state``; the rows are long enough to cross the chunked rules'
chunk boundaries."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.bamba import modeling_bamba
from transformers.models.lfm2 import modeling_lfm2
from transformers.models.qwen3_5 import modeling_qwen3_5

from nopad.inference.state_cache import StateCache, StateSlots
from nopad.packing.invariance import batch_invariant
from nopad.packing.mixers.hf_kernels import conv_recurrent_state
from nopad.packing.mixers.state import LayerState
from nopad.packing.varlen import VarlenMeta

DTYPES = (torch.float32, torch.bfloat16)
LENGTHS = [7, 90, 1, 40]  # the longest crosses the delta rule's chunk of 64 and the scan's of 16
pytestmark = pytest.mark.usefixtures("one_thread", "nopad_patches")


def _rows_of_step(t: int) -> tuple[list[int], list[int]]:
    """The sequences still decoding at step ``t`` and the row of their ``t``-th token."""
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    live = [i for i, n in enumerate(LENGTHS) if n > t]
    return live, [starts[i] + t for i in live]


def decode_steps(state: LayerState, dtype: torch.dtype, call) -> tuple[torch.Tensor, StateCache, list[int]]:
    """The row's tokens as the generator's decode steps run them: step ``t`` holds the ``t``-th
    token of every sequence that long, each from its state slot (slots out of row order, so the
    cache gathers and scatters, until one sequence is left). ``call(rows, nopad_meta,
    nopad_kv_cache)`` runs the kernel on those rows. Returns the outputs in row order, the cache
    and each sequence's slot (its final state there)."""
    slots = StateSlots(len(LENGTHS))
    cache = StateCache([state], slots, dtype, "cpu")
    held = [slots.acquire() for _ in LENGTHS]
    slot_of = [held[3], held[1], held[2], held[0]]
    outs = {}
    for t in range(max(LENGTHS)):
        live, rows = _rows_of_step(t)
        step_slots = [slot_of[i] for i in live]
        cache.begin(step_slots, step_slots if t == 0 else [], [1] * len(live))
        out = call(rows, VarlenMeta.from_lengths([1] * len(live)), SimpleNamespace(states=cache))
        cache.abandon()  # the layer's other kernel (its conv, its scan) is not run here
        outs.update(zip(rows, out.unbind(0)))
    return torch.stack([outs[r] for r in range(sum(LENGTHS))]), cache, slot_of


def _assert_equal(trainer: torch.Tensor, generator: torch.Tensor, what: str) -> None:
    assert trainer.dtype == generator.dtype and trainer.shape == generator.shape
    differ = int((trainer != generator).sum())
    assert differ == 0, (
        f"{what}: {differ} of {trainer.numel()} values differ, max gap {(trainer - generator).abs().max():.3g}"
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_delta_rule_packed_row_equals_decode_steps_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    total, heads, v_heads, dim = sum(LENGTHS), 2, 4, 16
    q, k = (torch.randn(1, total, heads, dim, generator=g).to(dtype) for _ in range(2))
    v = (torch.randn(1, total, v_heads, dim, generator=g) * 4).to(dtype)
    decay = -torch.rand(1, total, v_heads, generator=g) * 0.02  # slow; fp32, as the layer computes it
    beta = torch.rand(1, total, v_heads, generator=g).to(dtype)
    tensors = (q, k, v, decay, beta)
    rule = modeling_qwen3_5.torch_chunk_gated_delta_rule  # nopad's dispatcher around transformers' rule

    def step(rows, meta, kv_cache):
        out, _ = rule(
            *(t[:, rows] for t in tensors), nopad_meta=meta, nopad_kv_cache=kv_cache, use_qk_l2norm_in_kernel=True
        )
        return out[0]

    with batch_invariant():
        trainer, finals = rule(
            *tensors, nopad_meta=VarlenMeta.from_lengths(LENGTHS), output_final_state=True, use_qk_l2norm_in_kernel=True
        )
        state = conv_recurrent_state("rule", (1, 1), (v_heads, dim, dim))
        generator, cache, slot_of = decode_steps(state, dtype, step)
    # the fp32 states first: a rule run in another order changes most of their bits, but only a few
    # of the bf16 outputs (5 of 8,832 here, with the trainer on the chunked rule)
    _assert_equal(finals, cache.named["recurrent"][0][slot_of], "final states")
    _assert_equal(trainer[0], generator, "outputs")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mamba2_packed_row_equals_decode_steps_bitwise(dtype):
    g = torch.Generator().manual_seed(1)
    total, heads, head_dim, groups, size = sum(LENGTHS), 4, 8, 2, 16
    x = torch.randn(1, total, heads, head_dim, generator=g).to(dtype)
    dt = (torch.randn(1, total, heads, generator=g) * 0.5 - 2).to(dtype)  # with the bias, softplus ~0.1-0.5
    B, C = (torch.randn(1, total, groups, size, generator=g).to(dtype) for _ in range(2))
    A = -torch.rand(heads, generator=g) * 0.3  # slow decay; fp32, as the layer computes it
    skip = (torch.rand(heads, generator=g) * 0.01).to(dtype)  # D x small beside C state
    scan = dict(
        D=skip, dt_bias=torch.rand(heads, generator=g).to(dtype), dt_softplus=True, dt_limit=(0.0, float("inf")), z=None
    )
    hook = modeling_bamba.mamba2_chunk_scan  # nopad's hook around transformers' chunk scan

    def step(rows, meta, kv_cache):
        out = hook(
            x[:, rows],
            dt[:, rows],
            A,
            B[:, rows],
            C[:, rows],
            chunk_size=16,
            nopad_meta=meta,
            nopad_kv_cache=kv_cache,
            **scan,
        )
        return out[0]

    with batch_invariant():
        trainer = hook(x, dt, A, B, C, chunk_size=16, nopad_meta=VarlenMeta.from_lengths(LENGTHS), **scan)
        state = conv_recurrent_state("mixer", (1, 1), (heads, head_dim, size))
        generator, _, _ = decode_steps(state, dtype, step)
    _assert_equal(trainer[0], generator, "outputs")


@pytest.mark.parametrize("module, activation", [(modeling_lfm2, None), (modeling_bamba, "silu")], ids=["lfm2", "bamba"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_conv_packed_row_equals_decode_steps_bitwise(module, activation, dtype):
    g = torch.Generator().manual_seed(2)
    channels, width = 24, 4
    x = torch.randn(1, channels, sum(LENGTHS), generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)  # every tap as large as the token's own
    bias = torch.randn(channels, generator=g).to(dtype)
    conv = module.causal_conv1d_fn  # nopad's hook around transformers' conv

    def step(rows, meta, kv_cache):
        return conv(x[:, :, rows], weight, bias, activation=activation, nopad_meta=meta, nopad_kv_cache=kv_cache)[0].t()

    with batch_invariant():
        trainer = conv(x, weight, bias, activation=activation, nopad_meta=VarlenMeta.from_lengths(LENGTHS))
        generator, _, _ = decode_steps(conv_recurrent_state("conv", (channels, width - 1), None), dtype, step)
    _assert_equal(trainer[0].t(), generator, "outputs")
