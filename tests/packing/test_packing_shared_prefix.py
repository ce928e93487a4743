"""Shared-prefix rows (a prompt once, each completion attending to it: the depth-1 case of the
prefix-tree rows that ``pack_rollouts`` builds): the same log-probs, loss and gradients as the
sequences packed the usual way (prompt repeated per completion), and in batch-invariant mode the
same log-probs as the generator, bitwise."""

from __future__ import annotations

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.packing import batch_invariant
from nopad.packing.attention import BACKEND_ENV, varlen_attention
from nopad.packing.hf import use_nopad_attention
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs, pair_advantages
from tests.support.models import random_sequences, tiny_model

GROUPS = [(12, [5, 9, 7]), (10, [11, 4])]  # (prompt_len, completion_lens); windows are 8 tokens


def _close(got, want, rtol=1e-5, what=""):
    got, want = got.detach(), want.detach()
    err = float((got - want).abs().max())
    assert err <= rtol * float(want.abs().max()) + 1e-12, f"{what}: max error {err:.3g}"


# ----------------------------------------------------------------------------- the attention core
@pytest.mark.parametrize("backend", ["auto", "kernel", "sdpa_loop", "sdpa_padded", "per_token"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 20.0)])
def test_attention_reads_the_prompt_in_place_forward_and_backward(backend, window, softcap, one_thread):
    meta = VarlenMeta.shared_prefix(GROUPS)
    flat = VarlenMeta.from_lengths(meta.seqlens_k)  # the same sequences, prompt copied per completion
    g = torch.Generator().manual_seed(0)
    q = torch.randn(meta.total_q, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(meta.total_q, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(meta.total_q, 2, 16, generator=g, requires_grad=True)
    rows = meta.key_rows
    # reference: every sequence copied out (prompt repeated), keeping the outputs of its own tokens
    opts = dict(sliding_window=window, softcap=softcap)
    ref_full = varlen_attention(
        q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows), flat, backend="sdpa_loop", **opts
    )
    keep = torch.cat(
        [
            torch.arange(flat.cu_seqlens_q[i + 1] - meta.seqlens_q[i], flat.cu_seqlens_q[i + 1])
            for i in range(meta.num_seqs)
        ]
    )
    ref = ref_full[keep]
    out = varlen_attention(q, k, v, meta, backend=backend, **opts)
    _close(out, ref, what="forward")
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for name, got, want in zip("qkv", grads, refs):
        _close(got, want, what=f"d{name}")


def test_meta_layout_and_bad_input():
    meta = VarlenMeta.shared_prefix([(3, [2, 1])])
    assert meta.seqlens_q == (3, 2, 1) and meta.seqlens_k == (3, 5, 4)
    assert meta.position_ids.tolist() == [0, 1, 2, 3, 4, 3]
    assert meta.key_rows.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5]
    assert meta.previous_rows().tolist() == [-1, 0, 1, 2, 3, 2]  # completion 2 is predicted by row 2
    assert VarlenMeta.from_lengths([2, 3]).previous_rows().tolist() == [-1, 0, -1, 2, 3]
    with pytest.raises(ValueError, match="prompt_len 0"):
        VarlenMeta.shared_prefix([(0, [2])])
    with pytest.raises(ValueError, match="own keys"):
        varlen_attention(torch.zeros(6, 2, 8), torch.zeros(12, 2, 8), torch.zeros(12, 2, 8), meta)


def test_model_loss_on_a_shared_prefix_row_is_refused():
    model = tiny_model("llama")
    (row,) = pack_rollouts([Rollout([5, 6, 7], [8, 9]), Rollout([5, 6, 7], [10])], capacity=16)
    assert row.nopad_meta.key_index is not None
    with use_nopad_attention(model), pytest.raises(ValueError, match="previous_rows"):
        model(**row.model_kwargs(labels=True))


# ----------------------------------------------------------------------------- models
def _rollouts(seed=0):
    """GROUPS' prompts and completions as rollouts, each completion token with its own weight
    (as its advantage: the loss below is -sum(advantage * logp), one weight per token)."""
    seqs = iter(random_sequences([p for p, _ in GROUPS] + [c for _, cs in GROUPS for c in cs], seed=seed))
    prompts = [next(seqs).tolist() for _ in GROUPS]
    return [
        Rollout(prompts[g], next(seqs).tolist(), advantage=float(g - j))
        for g, (_, cs) in enumerate(GROUPS)
        for j in range(len(cs))
    ]


def _run(model, rows, rollouts):
    """Per-rollout log-probs (temperature 0.7) and the gradients of -sum(advantage * logp)."""
    got = {}
    with use_nopad_attention(model):
        for row in rows:
            lp = packed_logprobs(model, row, 0.7)
            (-(lp * pair_advantages(row, rollouts)).sum()).backward()
            order = row.indices.tolist()
            if row.pair_seqs is None:  # flat rows: the completions' tokens in label order
                parts = lp.detach().split([len(rollouts[i].completion_ids) for i in order])
            else:
                parts = [lp.detach()[row.pair_seqs == k] for k in range(len(order))]
            got.update(zip(order, parts))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return got, grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("capacity", [64, 28])  # one row; group 0 (12 + 5 + 9 + 7) split across rows
@pytest.mark.parametrize("backend", ["kernel", "sdpa_loop"])
def test_logprobs_loss_and_gradients_equal_usual_packing(family, capacity, backend, monkeypatch, one_thread):
    model = tiny_model(family)
    rollouts = _rollouts()
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    want, want_grads = _run(model, pack_rollouts(rollouts, 64, shared_prefix=False), rollouts)
    monkeypatch.setenv(BACKEND_ENV, backend)
    rows = pack_rollouts(rollouts, capacity)
    got, grads = _run(model, rows, rollouts)
    assert (len(rows) == 1) == (capacity == 64)
    assert sum(r.num_tokens for r in rows) < sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    assert sorted(got) == list(range(len(rollouts)))
    for i in got:
        _close(got[i], want[i], what=f"rollout {i} log-probs")
    for name, g in grads.items():
        _close(g, want_grads[name], what=f"grad of {name}")


# ----------------------------------------------------------------------------- generator == trainer
@pytest.mark.parametrize(
    "family,dtype",
    [("llama", torch.float32), ("mistral", torch.float32), ("gemma2", torch.float32), ("qwen2", torch.bfloat16)],
)
def test_shared_prefix_logprobs_equal_the_generators_bitwise(family, dtype, one_thread):
    model = tiny_model(family).to(dtype)
    prompts = [p.tolist() for p in random_sequences([14, 30, 5], seed=3)]
    params = SamplingParams(temperature=1.0, n=4, max_tokens=9, seed=2)
    with batch_invariant():
        outs = Generator(model, block_size=16, num_blocks=32).generate(prompts, params, use_tqdm=False)
        rollouts = [
            Rollout(list(p), list(c.token_ids), list(c.logprobs))
            for p, o in zip(prompts, outs)
            for c in o.outputs
            if c.token_ids
        ]
        with use_nopad_attention(model), torch.no_grad():
            rows = pack_rollouts(rollouts, capacity=40)  # the 30-token prompt's group is split
            trainer = torch.cat([packed_logprobs(model, row) for row in rows])
    generator = torch.cat([row.token_values["gen_logprobs"] for row in rows])
    assert any(r["nopad_meta"].key_index is not None for r in rows)
    assert sum(r["input_ids"].numel() for r in rows) < sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    prompt_rows = [tuple(r["input_ids"][0, :30].tolist()) for r in rows]
    assert prompt_rows.count(tuple(prompts[1])) >= 2  # split: its prompt repeated in each row
    assert trainer.numel() == generator.numel() > 0
    assert torch.equal(trainer, generator), f"max gap {(trainer - generator).abs().max():.3g}"
