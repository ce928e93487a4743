"""The step is normalised by the global loss-token (or sequence) count: packed training with
gradient accumulation on 2 ranks, stepped by the recipes' OptimizerStepper (``sft_step``: the
window, ``row_nll_sum`` through the chunked head), has the gradient of unpacked single-process
training."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.loader import packed_dataloader
from nopad.training import accumulation
from nopad.training.accumulation import OptimizerStepper
from nopad.training.loss import COUNT_KEYS, causal_lm_loss_sum, row_loss_sum
from nopad.training.sft import sft_step
from tests.support import launch
from tests.support.models import tiny_model


def _attn_implementation() -> str:
    """nopad's own varlen attention when the core has registered it, else SDPA (which builds a
    block-diagonal mask from packed position_ids when no attention_mask is given)."""
    try:
        from nopad.packing.hf import register_nopad_attention
    except ImportError:
        return "sdpa"
    register_nopad_attention()
    return "nopad"


def _rows(n=22, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for length in rng.integers(2, 30, size=n):
        ids = rng.integers(3, 128, size=length)
        labels = ids.copy()
        labels[: rng.integers(0, length // 2 + 1)] = -100  # a masked prompt
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def _reference_grads(rows, weighting):
    """Unpacked, one sequence at a time, one process: mean over all loss tokens (or sequences)."""
    model = tiny_model("llama", attn_implementation="sdpa")
    total, count = 0.0, 0
    for row in rows:
        ids = torch.tensor(row["input_ids"])[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        target = torch.tensor(row["labels"])[1:]
        losses = F.cross_entropy(logits, target, ignore_index=-100, reduction="none")
        n = int((target != -100).sum())
        if weighting == "token":
            total, count = total + losses.sum(), count + n
        elif n:
            total, count = total + losses.sum() / n, count + 1
    (total / count).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_token_and_sequence_weighting_by_hand():
    logits = torch.randn(1, 5, 7)
    collated = PackedCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, -100]}])
    labels, meta = collated["labels"], collated["nopad_meta"]  # [-100, 2, 3, -100, -100]
    ce = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="none")
    assert torch.allclose(causal_lm_loss_sum(logits, labels), ce.sum())
    assert collated["num_loss_tokens"] == 2 and collated["num_loss_seqs"] == 1
    by_seq = causal_lm_loss_sum(logits, labels, seq_idx=meta.seq_idx, weighting="sequence")
    assert torch.allclose(by_seq, (ce[0] + ce[1]) / 2)


def test_bad_arguments():
    model = torch.nn.Linear(2, 2)
    stepper = OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    row = PackedCollator()(_rows(n=2))
    with pytest.raises(ValueError, match="weighting"):
        sft_step(stepper, [row], "mean")
    with pytest.raises(ValueError, match="weighting"):
        row_loss_sum(torch.zeros(1, row.input_ids.shape[1], 3), row, weighting="mean")
    with pytest.raises(ValueError, match="seq_idx"):
        causal_lm_loss_sum(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), weighting="sequence")
    with pytest.raises(ValueError, match="at least one row"):
        with stepper.window([]):
            pass
    with pytest.raises(RuntimeError, match="more rows than the 1"):  # a window counts its rows
        with stepper.window([row]) as w:
            for _ in range(2):
                with w.row():
                    w.backward(model(torch.ones(2)).sum())
    assert stepper.optimizer_steps == 0 and all(p.grad is None for p in model.parameters())


def _step_grads(model, batches, weighting, world=None) -> dict:
    """The gradient that one optimizer step over ``batches`` (``sft_step``) applies, read in the
    optimizer's step pre-hook (the step then zeroes it). ``world``: ranks to simulate in-process."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    stepper = OptimizerStepper(model, optimizer)
    if world is not None:
        stepper.world = world  # DDP would average the gradients over that many ranks
    inner = getattr(model, "module", model)
    grads = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update({k: p.grad.clone() for k, p in inner.named_parameters()}))
    sft_step(stepper, batches, weighting)
    assert stepper.optimizer_steps == 1 and grads
    return grads


def _packed_worker(rank, world, port, attn, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    assert _attn_implementation() == attn  # registration is per process
    try:
        batches = list(packed_dataloader(_rows(), 64, seed=1))  # rank/world from torch.distributed
        result = {"seen": [i for b in batches for i in b["indices"].tolist()], "steps": len(batches)}
        for weighting in ("token", "sequence"):
            result[weighting] = _accumulate(batches, attn, weighting)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _accumulate(batches, attn, weighting):
    """One optimizer step accumulating the whole epoch; DDP syncs on the last row only."""
    model = torch.nn.parallel.DistributedDataParallel(tiny_model("llama", attn_implementation=attn))
    return _step_grads(model, batches, weighting)  # world size from torch.distributed


@pytest.mark.parametrize("weighting", ["token", "sequence"])
def test_simulated_two_ranks_in_process_match_unpacked(weighting, monkeypatch):
    """The fast version: both ranks' micro-batches run here; gradients averaged as DDP would."""
    attn = _attn_implementation()
    per_rank = [list(packed_dataloader(_rows(), 64, seed=1, num_replicas=2, rank=r)) for r in range(2)]
    total = sum(int(b[COUNT_KEYS[weighting]]) for b in per_rank[0] + per_rank[1])
    monkeypatch.setattr(accumulation, "global_sum", lambda local: float(total))  # the all-reduce's answer
    grads = [
        _step_grads(tiny_model("llama", attn_implementation=attn), batches, weighting, world=2) for batches in per_rank
    ]
    for name, ref in _reference_grads(_rows(), weighting).items():
        got = (grads[0][name] + grads[1][name]) / 2
        assert torch.linalg.norm(got - ref) <= 1e-5 * torch.linalg.norm(ref), name


@pytest.mark.slow
@pytest.mark.timeout(600)  # the spawn's own 300 s
def test_two_ranks_packed_with_accumulation_match_unpacked_single_process(tmp_path):
    attn = _attn_implementation()
    launch.spawn(_packed_worker, args=(2, launch.free_port(), attn, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"] >= 2  # equal steps, accumulation really used
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(len(_rows())))  # once each
    for weighting in ("token", "sequence"):
        reference = _reference_grads(_rows(), weighting)
        for name, ref in reference.items():
            for r in ranks:
                got = r[weighting][name]
                assert torch.linalg.norm(got - ref) <= 1e-5 * torch.linalg.norm(ref), (weighting, name)


@pytest.mark.parametrize("weighting", ["token", "sequence"])
@pytest.mark.parametrize("tree", [False, True])
def test_the_chunked_head_loss_equals_the_logits_loss(weighting, tree):
    """row_nll_sum (hidden states at the loss positions, chunked head) == row_loss_sum (every
    position's logits), values and gradients, on plain rows and on tree rows whose shared loss
    tokens count once per pair."""
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.grpo import Rollout, pack_rollouts
    from nopad.training.loss import row_loss_sum, row_nll_sum

    if tree:
        prompt = list(range(3, 15))
        (row,) = pack_rollouts(
            [Rollout(prompt, [5, 6, 7, 8]), Rollout(prompt, [5, 6, 9]), Rollout(prompt[:4], [10])], 64
        )
        assert row.pair_tokens is not None
    else:
        row = PackedCollator()(_rows(n=5))
    model = tiny_model("gemma2")  # a softcapped head
    results = []
    with use_nopad_attention(model):
        for loss in (
            lambda: row_nll_sum(model, row, weighting=weighting),
            lambda: row_loss_sum(model(**row.model_kwargs()).logits, row, weighting=weighting),
        ):
            model.zero_grad()
            value = loss()
            value.backward()
            results.append((float(value), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ours, grads), (ref, ref_grads) = results
    assert ours == pytest.approx(ref, rel=1e-6)
    for name, g in grads.items():
        assert float((g - ref_grads[name]).abs().max()) <= 1e-5 * float(ref_grads[name].abs().max()), name
