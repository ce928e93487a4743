"""Attention sinks (gpt-oss's ``s_aux``): every backend that declares them matches
transformers' eager formula (softmax over [scores, sink], the sink column dropped) in packed rows,
tree rows and paged steps, with the sinks' gradient; the backends that do not are never chosen
for a sink layer; gpt-oss runs packed, tree and in the generator exactly, and bitwise rollout ==
trainer in the batch-invariant mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nopad.inference import SamplingParams
from nopad.packing.attention import triton_kernel, varlen_attention
from nopad.packing.attention.registry import Call, backends, choose
from nopad.packing.invariance import batch_invariant
from nopad.packing.mixers import CONTEXTS, check_model
from nopad.packing.varlen import VarlenMeta
from tests.packing.test_packing_invariance import _gaps
from tests.support.models import random_sequences, tiny_model

HEADS, KV_HEADS, DIM = 4, 2, 16
SINK_BACKENDS = ("sdpa_loop", "sdpa_padded", "sdpa_dense", "per_token", "kernel")
# nopad's Triton kernel, on CPU under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
TRITON = pytest.mark.skipif(
    triton_kernel.triton is None or not (torch.cuda.is_available() or triton_kernel.interpreted()),
    reason="triton is not installed (or neither CUDA nor its interpreter)",
)


def eager_reference(q, k, v, meta, sinks, *, scale, window=None):
    """transformers' gpt-oss eager attention, one sequence at a time."""
    outs, groups = [], HEADS // KV_HEADS
    for i in range(meta.num_seqs):
        qs = slice(int(meta.cu_seqlens_q[i]), int(meta.cu_seqlens_q[i + 1]))
        ks = slice(int(meta.cu_seqlens_k[i]), int(meta.cu_seqlens_k[i + 1]))
        q_i, k_i, v_i = q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1)
        k_i, v_i = k_i.repeat_interleave(groups, 0), v_i.repeat_interleave(groups, 0)
        lq, lk = q_i.shape[1], k_i.shape[1]
        scores = q_i @ k_i.transpose(1, 2) * scale
        q_pos = torch.arange(lk - lq, lk, device=q.device)[:, None]
        k_pos = torch.arange(lk, device=q.device)[None, :]
        keep = k_pos <= q_pos
        if window is not None:
            keep &= k_pos > q_pos - window
        scores = scores.masked_fill(~keep, float("-inf"))
        logits = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, lq, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        outs.append((probs @ v_i).transpose(0, 1))
    return torch.cat(outs)


def _qkv(total_q, total_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(total_q, HEADS, DIM, generator=g),
        torch.randn(total_k, KV_HEADS, DIM, generator=g),
        torch.randn(total_k, KV_HEADS, DIM, generator=g),
        torch.randn(HEADS, generator=g) * 2,
    )


@pytest.mark.parametrize("backend", SINK_BACKENDS + (pytest.param("triton", marks=TRITON),))
@pytest.mark.parametrize("window", [None, 5])
def test_every_sink_backend_matches_the_eager_formula_with_its_gradients(backend, window):
    meta = VarlenMeta.from_lengths([1, 7, 20])
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v, sinks = (t.to(device).requires_grad_() for t in _qkv(meta.total_q, meta.total_k))
    meta = meta.to(device)
    out = varlen_attention(q, k, v, meta, softmax_scale=0.25, sliding_window=window, sinks=sinks, backend=backend)
    ref = eager_reference(q, k, v, meta, sinks, scale=0.25, window=window)
    plain = varlen_attention(q, k, v, meta, softmax_scale=0.25, sliding_window=window, backend=backend)
    assert (plain - ref).abs().max() > 1e-2  # the sinks change the answer: the test can fail
    assert (out - ref).abs().max() < 2e-6
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    refs = torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    for got, want in zip(grads, refs):
        assert (got - want).abs().max() < 2e-5


@pytest.mark.parametrize("backend", ["kernel", "sdpa_loop", pytest.param("triton", marks=TRITON)])
def test_paged_steps_with_sinks_match_the_eager_formula(backend):
    """A prefill chunk and a decode token reading a paged cache in scattered blocks (the
    generator's steps)."""
    lengths, context, block = [9, 1], [4, 40], 16
    q, k, v, sinks = _qkv(sum(lengths), sum(lengths) + sum(context), seed=1)
    full = VarlenMeta.for_step(lengths, context)
    ref = eager_reference(q, k, v, full, sinks, scale=0.25)
    need = [-(-(n + c) // block) for n, c in zip(lengths, context)]
    order = torch.randperm(sum(need) + 2, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    table[0, : need[0]], table[1, : need[1]] = order[: need[0]], order[need[0] : sum(need)]
    cache = (torch.zeros(len(order), block, KV_HEADS, DIM), torch.zeros(len(order), block, KV_HEADS, DIM))
    slots, start = [], 0
    for i, (n, c) in enumerate(zip(lengths, context)):
        positions = torch.arange(n + c)
        rows = table[i, positions // block].long() * block + positions % block
        cache[0].view(-1, KV_HEADS, DIM)[rows[:c]] = k[start : start + c]
        cache[1].view(-1, KV_HEADS, DIM)[rows[:c]] = v[start : start + c]
        slots.append(rows[c:])
        start += n + c
    step = VarlenMeta.for_step(lengths, context, block_table=table, slot_mapping=torch.cat(slots))
    new = torch.cat(
        [torch.arange(int(full.cu_seqlens_k[i]) + c, int(full.cu_seqlens_k[i + 1])) for i, c in enumerate(context)]
    )
    with torch.no_grad():
        out = varlen_attention(
            q, k[new], v[new], step, softmax_scale=0.25, kv_cache=cache, sinks=sinks, backend=backend
        )
    assert (out - ref).abs().max() < 2e-6


def test_backends_without_sinks_are_never_chosen_and_refused_by_name():
    declared = {name for name, b in backends().items() if b.sinks}
    assert declared == {*SINK_BACKENDS, "triton"}
    for device in ("cpu", "cuda"):
        for kwargs in (dict(), dict(paged=True, block_size=256), dict(grad=True)):
            call = Call(torch.device(device), torch.bfloat16, sinks=True, **kwargs)
            assert choose(call).sinks
    meta = VarlenMeta.from_lengths([4])
    q, k, v, sinks = (t.to(torch.bfloat16) for t in _qkv(4, 4))
    for name in ("flash", "torch_varlen", "flex"):
        with pytest.raises((ValueError, RuntimeError), match="does not take attention sinks"):
            varlen_attention(q, k, v, meta, sinks=sinks, backend=name)


def test_sinks_of_the_wrong_shape_are_refused():
    meta = VarlenMeta.from_lengths([4])
    q, k, v, _ = _qkv(4, 4)
    with pytest.raises(ValueError, match="one logit per query head"):
        varlen_attention(q, k, v, meta, sinks=torch.zeros(KV_HEADS))


def strong_sinks(model):
    """``model`` (gpt-oss) with sinks large enough to matter (the random init draws them near zero)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g) * 2)
    return model


@pytest.fixture(scope="module")
def gpt_oss():
    return strong_sinks(tiny_model("gpt_oss"))


def test_gpt_oss_passes_every_context(gpt_oss):
    """Its verify and generator runs are in tests/inference/test_inference_layouts.py, with the
    other layouts."""
    for context in CONTEXTS:
        check_model(gpt_oss, context)


class PositionWise(nn.Module):
    """A stand-in for gpt-oss's MoE block: its eager expert loop multiplies each expert's routed
    tokens in one matmul, whose rows depend on the batch, so MoE layers are not batch-invariant
    (nor meant to be by this test). A plain linear layer is, and leaves the sink attention as
    the thing measured."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, hidden_states):
        return self.proj(hidden_states), None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sink_attention_rollout_equals_trainer_bitwise(gpt_oss, dtype, one_thread):
    model = tiny_model("gpt_oss")
    model.load_state_dict(gpt_oss.state_dict())
    torch.manual_seed(0)
    for layer in model.model.layers:
        layer.mlp = PositionWise(model.config.hidden_size)
    model = model.to(dtype)
    prompts = [p.tolist() for p in random_sequences([3, 21, 9], seed=8)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=8, seed=1)
    trainer, generator, _ = _gaps(
        model,
        prompts,
        params,
        dict(max_num_batched_tokens=11, max_num_seqs=4, num_blocks=16, block_size=16),
        capacity=64,
    )
    assert trainer.numel() == generator.numel() > 0
    assert torch.equal(trainer, generator), f"max gap {(trainer - generator).abs().max():.3g}"


def test_batch_invariant_training_row_with_sinks_has_the_eager_gradient():
    """The compiled kernel's forward with the recomputed backward (RecomputeBackward) carries the
    sinks' gradient."""
    meta = VarlenMeta.from_lengths([3, 17])
    q, k, v, sinks = (t.requires_grad_() for t in _qkv(20, 20, seed=3))
    with batch_invariant():
        out = varlen_attention(q, k, v, meta, softmax_scale=0.25, sinks=sinks)
    ref = eager_reference(q, k, v, meta, sinks, scale=0.25)
    assert (out - ref).abs().max() < 2e-6
    w = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad((out * w).sum(), (q, k, v, sinks)), torch.autograd.grad((ref * w).sum(), (q, k, v, sinks))
    ):
        assert (got - want).abs().max() < 2e-5


def test_a_kernel_built_before_sinks_is_passed_over_for_sink_layers_only(monkeypatch):
    """An extension built from an older csrc/ has no ``sinks=``: sink layers run the exact PyTorch
    paths instead, every other layer still runs the kernel."""
    from nopad.packing.attention import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "takes_sinks", lambda: False)
    paged = dict(paged=True, block_size=16)
    assert choose(Call(torch.device("cpu"), torch.float32, sinks=True, **paged)).name == "sdpa_loop"
    assert choose(Call(torch.device("cpu"), torch.float32, sinks=True, invariant=True)).name == "per_token"
    assert choose(Call(torch.device("cpu"), torch.float32, **paged)).name == "kernel"
