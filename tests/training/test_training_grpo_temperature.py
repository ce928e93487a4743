"""Which policy GRPO trains (``rollout.logprobs``, ``GRPOStepConfig.logprobs``): by default the one the
rollouts were sampled from, ``softmax(logits / T)`` (TRL's semantics), on both sides, bitwise in
``nopad.packing.batch_invariant()``; ``raw`` (``softmax(logits)``) only when asked for."""

from __future__ import annotations

import copy

import pytest
import torch

from nopad.recipes.config import ConfigError
from nopad.recipes.tasks import get_reward
from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training.grpo import LOGPROBS, Rollout, policy_temperature
from nopad.training.grpo_step import GRPOStepConfig
from tests.recipes.test_recipes_grpo import tiny_config

T = 0.7


def run_recorded_step(monkeypatch, logprobs: str, dtype: torch.dtype, beta: float = 0.0, **train):
    """One recipe GRPO step at temperature ``T`` in the batch-invariant mode, with no update
    (lr 0), recording the rollouts and the temperature handed to the trainer. Returns (metrics,
    rollouts, temperature, policy)."""
    from accelerate import Accelerator

    import nopad.training.grpo_step
    from nopad.inference import Generator
    from nopad.packing.hf import NOPAD_ATTENTION, register_nopad_attention, use_nopad_attention
    from nopad.recipes.grpo import build_prompts, grpo_loss
    from nopad.recipes.grpo_rollouts import sampling_params
    from nopad.training.accumulation import OptimizerStepper
    from tests.support.models import tiny_model

    seen = {}
    real = nopad.training.grpo_step.train_on_rollouts

    def recording(stepper, rollouts, loss, **kw):
        seen.update(rollouts=rollouts, temperature=kw["temperature"], logprobs=loss.logprobs)
        return real(stepper, rollouts, loss, **kw)

    monkeypatch.setattr(nopad.training.grpo_step, "train_on_rollouts", recording)
    policy = tiny_model("qwen2").to(dtype)
    cfg = tiny_config(
        rollout={"temperature": T, "logprobs": logprobs}, train={"batch_invariant": True, **train}, loss={"beta": beta}
    )
    tok = AsciiTokenizer()
    examples, prompt_ids = build_prompts(cfg, tok)
    gen = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=40)
    stepper = OptimizerStepper(policy, torch.optim.SGD(policy.parameters(), lr=0.0), Accelerator(cpu=True))
    ref = None
    if beta:  # as the recipe builds it: a frozen copy on nopad's attention
        register_nopad_attention()
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
        ref.set_attn_implementation(NOPAD_ATTENTION)
    with use_nopad_attention(policy):
        m = nopad.training.grpo_step.grpo_step(
            stepper,
            gen,
            examples[:3],
            prompt_ids[:3],
            get_reward(cfg.reward),
            tok,
            sampling_params(cfg, 0),
            grpo_loss(cfg, policy.device),
            ref_model=ref,
        )
    assert seen["logprobs"] == logprobs and seen["temperature"] == T
    return m, seen["rollouts"], policy


def unpacked_logprobs(policy, rollouts: list[Rollout], temperature: float) -> list[torch.Tensor]:
    """``log_softmax(logits / temperature)`` at each completion token, from the model's own
    forward on each sequence alone (no nopad attention, no packing)."""
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = policy(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
            lp = torch.log_softmax(logits / temperature, -1)
            out.append(lp.gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tempered_logprobs_are_the_sampled_policys_and_bitwise_the_trainers(monkeypatch, dtype, one_thread):
    """At T = 0.7 (the default ``rollout.logprobs=tempered``) the rollout's log-probs are
    ``log_softmax(logits / T)``, and the trainer scores the same policy: every token's gap is
    exactly 0 and the ratio exactly 1 in the mode, fp32 and bf16. The KL reference is scored at T
    too (a copy of the policy: exactly 0). Before, the trainer scored raw log-probs on both sides."""
    m, rollouts, policy = run_recorded_step(monkeypatch, "tempered", dtype, beta=0.1)
    atol = 1e-5 if dtype == torch.float32 else 1e-2  # the model's own forward: other kernels
    got = torch.cat([torch.tensor(r.gen_logprobs) for r in rollouts])
    want, raw = (torch.cat(unpacked_logprobs(policy, rollouts, t)) for t in (T, 1.0))
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert (got - raw).abs().max() > 10 * (got - want).abs().max()  # not the raw ones
    assert m["logprob_gap_max"] == 0.0 and m["is_ratio_min"] == m["is_ratio_max"] == 1.0
    assert m["mismatch/ratio_dev_max"] == 0.0 and m["ratio_dev_max"] == 0.0
    assert m["kl"] == 0.0


def test_raw_is_an_explicit_choice_and_also_bitwise(monkeypatch, one_thread):
    """``rollout.logprobs=raw``: the rollout records and the trainer scores ``softmax(logits)`` (the
    samples still come from T = 0.7, so this trains off-policy, by choice)."""
    m, rollouts, policy = run_recorded_step(monkeypatch, "raw", torch.float32)
    want = unpacked_logprobs(policy, rollouts, 1.0)
    got = [torch.tensor(r.gen_logprobs) for r in rollouts]
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=0)
    assert m["logprob_gap_max"] == 0.0 and m["is_ratio_min"] == m["is_ratio_max"] == 1.0


def test_recomputed_old_logprobs_score_the_tempered_policy_too(monkeypatch, one_thread):
    """``train.old_logprobs=recompute`` over two passes: the trainer's no-grad forward before the
    updates scores ``softmax(logits / T)`` as well, so it equals the rollout's, bitwise."""
    m, _, _ = run_recorded_step(monkeypatch, "tempered", torch.float32, old_logprobs="recompute", num_iterations=2)
    assert m["optimizer_steps"] == 2 and m["logprob_gap_max"] == 0.0 and m["ratio_dev_max"] == 0.0


def test_the_trained_policys_temperature():
    assert policy_temperature("tempered", T) == T
    assert policy_temperature("raw", T) == 1.0
    assert policy_temperature("tempered", 0.0) == 1.0  # greedy: the recorded log-prob is the raw one
    with pytest.raises(ValueError, match=r"logprobs must be one of \('tempered', 'raw'\), got 'processed'"):
        GRPOStepConfig(logprobs="processed")


def test_a_rollout_takes_the_trained_policys_logprobs_from_the_generator():
    from types import SimpleNamespace

    sample = SimpleNamespace(
        token_ids=[20, 21], logprobs=[-3.0, -4.0], temperature_logprobs=[-2.5, -5.0], finish_reason="stop"
    )
    assert Rollout.from_completion([1], sample).gen_logprobs == [-2.5, -5.0]  # tempered: the default
    assert Rollout.from_completion([1], sample, "raw").gen_logprobs == [-3.0, -4.0]
    episode = SimpleNamespace(
        prompt_token_ids=[1],
        completion_ids=[10, 11],
        logprobs=[-1.0, 0.0],
        temperature_logprobs=[-0.5, 0.0],
        model_mask=[1, 0],
        finish_reason="stop",
    )
    assert Rollout.from_episode(episode).gen_logprobs == [-0.5]
    assert Rollout.from_episode(episode, "raw").gen_logprobs == [-1.0]


def test_the_recipe_setting_defaults_to_tempered_and_names_its_values():
    import typing

    from nopad.recipes.grpo import grpo_loss
    from nopad.recipes.grpo_checkpoint import resume_settings
    from nopad.recipes.grpo_config import RolloutConfig

    cfg = tiny_config()
    assert cfg.rollout.logprobs == "tempered" and grpo_loss(cfg, "cpu").logprobs == "tempered"
    assert grpo_loss(tiny_config(rollout={"logprobs": "raw"}), "cpu").logprobs == "raw"
    assert typing.get_args(typing.get_type_hints(RolloutConfig)["logprobs"]) == LOGPROBS
    assert resume_settings(cfg)["rollout.logprobs"] == "tempered"  # a resume may not switch the policy
    with pytest.raises(ConfigError) as err:
        tiny_config(rollout={"logprobs": "processed"})
    assert str(err.value) == "rollout.logprobs must be 'tempered' or 'raw', got 'processed'"
