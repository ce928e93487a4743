"""Several optimizer steps per rollout batch (``num_iterations`` x ``steps_per_generation``): in the
batch-invariant mode the old log-probs are the rollout's own, exactly, with no extra forward."""

from __future__ import annotations

import pytest
import torch

from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training.grpo_step import GRPOStepConfig
from nopad.training.policy_loss import PolicyLossConfig


def run_step(loss: GRPOStepConfig, lr: float = 1e-2, dtype=torch.float32):
    from accelerate import Accelerator

    from nopad.inference import Generator
    from nopad.packing.hf import use_nopad_attention
    from nopad.recipes.grpo import build_prompts
    from nopad.recipes.grpo_rollouts import sampling_params
    from nopad.recipes.tasks import get_reward
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import grpo_step
    from tests.recipes.test_recipes_grpo import tiny_config
    from tests.support.models import tiny_model

    torch.manual_seed(0)
    policy = tiny_model("llama").to(dtype)
    cfg = tiny_config()
    tok = AsciiTokenizer()
    examples, prompt_ids = build_prompts(cfg, tok)
    gen = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=256)
    stepper = OptimizerStepper(policy, torch.optim.SGD(policy.parameters(), lr=lr), Accelerator(cpu=True))
    steps = []
    stepper.torch_optimizer.register_step_post_hook(lambda *_: steps.append(1))
    with use_nopad_attention(policy):
        metrics = grpo_step(
            stepper, gen, examples[:4], prompt_ids[:4], get_reward(cfg.reward), tok, sampling_params(cfg, 0), loss
        )
    return metrics, len(steps)


def test_in_the_mode_the_first_mini_batch_ratio_is_exactly_one_with_no_old_forward(one_thread):
    loss = GRPOStepConfig(
        num_iterations=2, steps_per_generation=2, batch_invariant=True, policy=PolicyLossConfig(loss_type="grpo")
    )
    m, taken = run_step(loss)
    assert taken == m["optimizer_steps"] == 4
    assert m["ratio_dev_max_first_step"] == 0.0  # old = the rollout's, and they are the trainer's bitwise
    assert m["ratio_dev_max"] > 0  # the later steps see the updated policy
    # each row's training forward once per pass (2 passes, 4 steps): no old-log-prob forward
    assert m["forwards_per_optimizer_step"] == m["train_rows"] * 2 / 4
    assert m["logprob_gap_max"] == 0.0


def test_without_updates_every_mini_batch_ratio_stays_exactly_one(one_thread):
    """The ratio moves only through the parameter updates: with lr=0 it is 1 on every step."""
    m, _ = run_step(GRPOStepConfig(num_iterations=3, steps_per_generation=2, batch_invariant=True), lr=0.0)
    assert m["ratio_dev_max"] == 0.0 and m["optimizer_steps"] == 6


def test_recompute_scores_the_batch_once_before_the_updates(one_thread):
    loss = GRPOStepConfig(
        num_iterations=2,
        steps_per_generation=2,
        batch_invariant=False,
        old_logprobs="recompute",
        policy=PolicyLossConfig(is_correction="sequence_mask"),
    )
    m, taken = run_step(loss, dtype=torch.bfloat16)
    assert taken == 4
    # each row's training forward once per pass, and one old-log-prob forward per row before the updates
    assert m["forwards_per_optimizer_step"] == m["train_rows"] * (2 + 1) / 4
    assert m["ratio_dev_max_first_step"] == 0.0  # old = the trainer's own, before any update
    assert m["logprob_gap_max"] > 0  # bf16 without the mode: the rollout differs, and it is reported
    assert "mismatch/is/tokens_touched" in m and "mismatch/is/seqs_touched" in m


def test_old_logprobs_from_the_rollout_cannot_be_is_corrected():
    with pytest.raises(ValueError, match="old_logprobs=rollout makes them the same numbers"):
        GRPOStepConfig(policy=PolicyLossConfig(is_correction="token_truncate"))


def test_masked_truncated_completions_carry_no_loss(one_thread):
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo import Rollout
    from nopad.training.grpo_step import train_on_rollouts
    from tests.support.models import tiny_model

    def step(truncated: list[bool]) -> dict:
        torch.manual_seed(0)
        model = tiny_model("llama")
        rollouts = [
            Rollout([5, 6, 7], [8 + i, 9, 10], [-1.0] * 3, advantage=a, truncated=t)
            for i, (a, t) in enumerate(zip([1.0, -1.0, 0.5, -0.5], truncated))
        ]
        loss = GRPOStepConfig(mask_truncated_completions=True)
        with use_nopad_attention(model):
            return train_on_rollouts(
                OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1)), rollouts, loss
            )

    assert step([True] * 4)["grad_norm"] == 0.0
    assert step([False, True, True, True])["grad_norm"] > 0.0  # (A > 0: its ratio far below 1 is not clipped)


def test_reward_scaling_modes():
    from nopad.training.grpo import group_advantages

    rewards = torch.tensor([[1.0, 0.0], [3.0, 3.0]])
    torch.testing.assert_close(group_advantages(rewards, scale_rewards="none"), torch.tensor([[0.5, -0.5], [0.0, 0.0]]))
    batch = group_advantages(rewards, scale_rewards="batch")
    torch.testing.assert_close(batch, torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / (rewards.std() + 1e-4))
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(rewards, scale_rewards="rank")
