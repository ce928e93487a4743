"""GRPO on prefix-tree rows (``pack_rollouts``): rollouts forked after a model turn share that
turn's tokens, which several rollouts train on, each with its own advantage. One optimizer step
on tree rows gives the parameters flat packing gives (the shared token weighted by the number of
rollouts that train on it, the step's normalisation unchanged), and in ``nopad.packing.batch_invariant()``
the trainer's log-probs on forked episodes equal the generator's bitwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.packing import batch_invariant
from nopad.packing.hf import use_nopad_attention
from nopad.training.accumulation import OptimizerStepper
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs
from nopad.training.grpo_step import GRPOStepConfig, train_on_rollouts
from tests.inference.test_inference_episodes import STOPS, TOOLS, TokenFormat, prompts_of
from tests.support.models import tiny_model


def forked_rollouts(seed=0, vocab=128):
    """Two prompts; a model turn, then two branches (a tool result and a model turn each), then
    two more (a model turn): 4 rollouts per prompt whose completions share model tokens. Each with
    generator log-probs near the model's (so some ratios clip) and its own advantage."""
    rng = np.random.default_rng(seed)

    def ids(n):
        return rng.integers(3, vocab, n).tolist()

    rollouts = []
    for prompt_len in (9, 14):
        prompt, first = ids(prompt_len), ids(int(rng.integers(3, 7)))
        for _ in range(2):
            middle = ids(int(rng.integers(2, 5))) + ids(int(rng.integers(1, 6)))
            for _ in range(2):
                completion = first + middle + ids(int(rng.integers(1, 6)))
                gen_logprobs = (-4.5 + rng.normal(0, 0.2, len(completion))).tolist()
                rollouts.append(Rollout(prompt, completion, gen_logprobs, advantage=float(rng.normal())))
    return rollouts


def _grad_recorder(params) -> torch.optim.SGD:
    """SGD that keeps the gradients of its step: what the step's window accumulated, normalised.
    A pre-step hook, not an overridden ``step``: torch wraps every class's ``step`` with the step
    hooks, so a subclass calling ``super().step`` would run the post hooks twice once SGD is wrapped."""
    optimizer = torch.optim.SGD(params, lr=0.5)

    def record(opt, *_):
        opt.grads = [p.grad.detach().clone() for group in opt.param_groups for p in group["params"]]

    optimizer.register_step_pre_hook(record)
    return optimizer


def _step(rollouts, shared_prefix, capacity):
    """One GRPO optimizer step (one window of every row); its metrics and gradients."""
    model = tiny_model("llama")
    loss = GRPOStepConfig(max_tokens_per_batch=capacity, shared_prefix=shared_prefix)
    optimizer = _grad_recorder(model.parameters())
    with use_nopad_attention(model):
        metrics = train_on_rollouts(OptimizerStepper(model, optimizer), rollouts, loss)
    return dict(zip((n for n, _ in model.named_parameters()), optimizer.grads)), metrics


@pytest.mark.parametrize("capacity", [256, 40])  # every tree in one row; trees split across rows
def test_grpo_step_on_forked_rollouts_equals_flat_packing(capacity, one_thread):
    rollouts = forked_rollouts()
    rows = pack_rollouts(rollouts, capacity)
    assert (len(rows) > 2) == (capacity == 40)
    # model tokens shared after the fork: labelled once, trained by several rollouts
    assert sum(r.num_loss_tokens for r in rows) > sum(int((r.labels != -100).sum()) for r in rows)
    assert sum(r.num_loss_tokens for r in rows) == sum(len(r.completion_ids) for r in rollouts)
    want_grads, flat = _step(rollouts, False, 256)
    grads, tree = _step(rollouts, True, capacity)
    assert tree["train_tokens"] < flat["train_tokens"] == tree["flat_train_tokens"]
    assert tree["tree_token_saving"] > 0 and flat["tree_token_saving"] == 0
    assert 0 < tree["clip_fraction"] == flat["clip_fraction"]
    assert tree["loss"] == pytest.approx(flat["loss"], rel=1e-5)
    assert max(float(g.abs().max()) for g in want_grads.values()) > 0
    for name, want in want_grads.items():
        err = float((grads[name] - want).abs().max())
        assert err <= 1e-5 * float(want.abs().max()) + 1e-12, f"grad of {name}: max error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_row_logprobs_equal_the_rollouts_on_forked_episodes_bitwise(dtype, one_thread):
    """Episodes forked after their first turn (nopad.inference.episodes) -> rollouts (every token
    after the prompt; the generator's log-probs at model tokens) -> tree rows -> the trainer's
    log-probs, at every model token of every branch, in the batch-invariant mode."""
    model = tiny_model("llama").to(dtype)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, stop_token_ids=STOPS, ignore_eos=True, n=2)
    from nopad.inference.episodes import EpisodeLimits

    with batch_invariant():
        episodes = Generator(model, block_size=4, num_blocks=256).run_episodes(
            prompts_of([3, 7, 12, 5]),
            TOOLS,
            params,
            limits=EpisodeLimits(max_turns=3, max_tokens=40),
            tool_format=TokenFormat(),
            fork=lambda ep: 2 if ep.num_turns == 1 else 1,
        )
        rollouts = [Rollout(e.prompt_token_ids, e.completion_ids, e.logprobs) for e in episodes]
        with use_nopad_attention(model), torch.no_grad():
            rows = pack_rollouts(rollouts, capacity=64)
            trainer = [packed_logprobs(model, row) for row in rows]
    assert any(len(e.branch) == 2 for e in episodes)  # some episodes forked at a tool call
    assert sum(r.num_tokens for r in rows) < sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    compared = 0
    for row, lp in zip(rows, trainer):
        for k, i in enumerate(row.indices.tolist()):
            model_tokens = torch.tensor(episodes[i].model_mask, dtype=torch.bool)
            mine = row.pair_seqs == k
            got, want = lp[mine][model_tokens], row.token_values["gen_logprobs"][mine][model_tokens]
            assert torch.equal(got, want), f"episode {i}: max gap {(got - want).abs().max():.3g}"
            compared += int(model_tokens.sum())
    assert compared == sum(sum(e.model_mask) for e in episodes) > 0
