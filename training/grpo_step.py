"""One GRPO step, owned here: prompts -> rollouts on the live weights -> rewards and group
advantages -> packed rows -> the training forward's log-probs -> the clipped token loss -> one
optimizer step (:class:`nopad.training.accumulation.OptimizerStepper`) -> the step's metrics.

The recipe (``recipes/grpo.py``) calls :func:`grpo_step`; code that already holds its rollouts
(tests, other samplers) calls :func:`train_on_rollouts`. ``NopadGRPOTrainer`` keeps TRL's loss
and step but packs and scores with the same :mod:`nopad.training.grpo` functions, and a test holds the
two steps to the same parameters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from nopad.inference.episodes import Episode
from nopad.inference.sharded import sharded_generate
from nopad.packing.distributed import any_rank, global_sum
from nopad.packing.invariance import batch_invariant
from nopad.training.accumulation import OptimizerStepper
from nopad.training.grpo import (
    SCALE_REWARDS,
    Rollout,
    group_advantages,
    packed_logprobs,
    packing_metrics,
    policy_temperature,
)
from nopad.training.grpo_episodes import ToolEpisodes, run_episodes
from nopad.training.grpo_minibatch import MiniBatch, StepMetrics, minibatches, train_window
from nopad.training.mismatch import logprob_mismatch
from nopad.training.nonfinite import describe_sample, reward_value
from nopad.training.policy_loss import PolicyLossConfig, make_policy_loss

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, Mapping], float]  # (completion, example) -> reward: the one reward type
EpisodeRewardFn = Callable[[Episode, Mapping], float]  # (episode, example) -> reward: task.environment's


OLD_LOGPROBS = ("rollout", "recompute")


@dataclass
class GRPOStepConfig:
    """What turns rollouts into a step's optimizer steps: the packing, the policy loss
    (:mod:`nopad.training.policy_loss`, TRL's ``loss_type`` and knobs), the reward scaling, how many
    optimizer steps a rollout batch feeds and where the old log-probs come from.

    ``old_logprobs``: ``"rollout"`` (the generator's own: exact in the batch-invariant mode, no
    extra forward; outside it the mismatch is reported) or ``"recompute"`` (the trainer's, from one
    no-grad forward before the first update when a batch feeds several steps; needed by
    ``policy.is_correction``, which weighs them against the rollout's). ``logprobs``: the trained
    policy, ``"tempered"`` ``softmax(logits / T)`` at the sampling ``T`` (TRL's) or ``"raw"``."""

    max_tokens_per_batch: int = 1024
    shared_prefix: bool = True  # rollouts packed as a prefix tree: shared prefixes computed once
    policy: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    scale_rewards: str = "group"  # group | batch | none (TRL's)
    mask_truncated_completions: bool = False  # a completion cut by the token limit carries no loss
    num_iterations: int = 1  # passes over each rollout batch (TRL's num_iterations, mu)
    steps_per_generation: int = 1  # mini-batches per pass, one optimizer step each
    old_logprobs: str = "rollout"
    logprobs: str = "tempered"
    batch_invariant: bool = False  # the forwards run in nopad.packing.batch_invariant() (already resolved)

    def __post_init__(self) -> None:
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {self.scale_rewards!r}")
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}")
        policy_temperature(self.logprobs, 1.0)  # a ValueError naming LOGPROBS for any other value
        if self.num_iterations < 1 or self.steps_per_generation < 1:
            raise ValueError(
                "num_iterations and steps_per_generation must be >= 1, got "
                f"{self.num_iterations} and {self.steps_per_generation}"
            )
        self.policy.check_old_logprobs(self.old_logprobs)


def grpo_step(
    stepper: OptimizerStepper,
    generator,
    examples: Sequence[dict],
    prompt_ids: Sequence[list[int]],
    reward_fn: RewardFn,
    tokenizer,
    params,
    loss: GRPOStepConfig,
    *,
    step: int = 0,
    rollout_mode: str = "gather",
    ref_model=None,
    use_tqdm: bool = False,
    episodes: ToolEpisodes | None = None,
) -> dict:
    """One GRPO step on ``examples`` (their prompt token ids in ``prompt_ids``; ``params``: the
    generator's ``SamplingParams`` with ``n`` completions per prompt). Every rank calls it each step,
    also with no examples. ``episodes``: multi-turn tool rollouts, trained on the model's tokens
    only and rewarded on the last model turn, or as whole episodes
    (:mod:`nopad.training.grpo_episodes`). Returns the step's metrics."""
    t0 = time.perf_counter()
    episode_metrics = {}
    with batch_invariant(loss.batch_invariant):
        if episodes is None:
            outputs = sharded_generate(
                generator, stepper.model, list(prompt_ids), params, mode=rollout_mode, use_tqdm=use_tqdm
            )
            samples = [
                [(c.token_ids, Rollout.from_completion(ids, c, loss.logprobs)) for c in out.outputs]
                for ids, out in zip(prompt_ids, outputs)
            ]
        else:
            samples, episode_metrics = run_episodes(
                generator, stepper.model, prompt_ids, params, episodes, loss.logprobs, examples
            )
    rollout_time = time.perf_counter() - t0
    generator.release()  # the KV cache goes back before any backward pass
    metrics = score_and_train(
        stepper,
        samples,
        examples,
        reward_fn,
        tokenizer,
        loss,
        step=step,
        temperature=params.temperature,
        ref_model=ref_model,
    )
    return {
        **metrics,
        **episode_metrics,
        "rollout_tokens_per_s": metrics["completion_tokens"] / rollout_time,
        "rollout_s": rollout_time,
    }


def score_and_train(
    stepper: OptimizerStepper,
    samples: Sequence[Sequence[tuple]],
    examples: Sequence[dict],
    reward_fn: RewardFn | EpisodeRewardFn,
    tokenizer,
    loss: GRPOStepConfig,
    *,
    step: int,
    temperature: float,
    ref_model=None,
) -> dict:
    """Everything after the rollouts, one implementation for the synchronous and the streaming step:
    ``samples`` per group (prompt), per completion ``(what the reward reads, Rollout)``; rewards,
    group advantages, then :func:`train_on_rollouts`. Returns the step's metrics."""
    rollouts = [rollout for group in samples for _, rollout in group]
    answers = [[answer for answer, _ in group] for group in samples]  # what each reward reads
    rewards = score_rollouts(reward_fn, tokenizer, examples, answers, step)
    rewards_t = torch.tensor(rewards).view(len(samples), -1) if samples else torch.zeros(0, 2)
    set_advantages(rollouts, rewards_t, step, loss.scale_rewards)
    metrics = train_on_rollouts(stepper, rollouts, loss, temperature=temperature, ref_model=ref_model, step=step)
    return {"step": step, "reward_mean": float(rewards_t.mean()), "reward_std": float(rewards_t.std()), **metrics}


def score_rollouts(
    reward_fn: RewardFn | EpisodeRewardFn,
    tokenizer,
    examples: Sequence[dict],
    answers: Sequence[Sequence[Sequence[int] | Episode]],
    step: int,
) -> list[float]:
    """Every completion's reward, in rollout order (``answers``: per prompt, per completion, the token
    ids the reward reads as text, or the Episode an episode reward reads whole), each checked to be
    one finite number (an error
    names the reward, the step and the sample). Every rank joins one all-reduce after scoring, so a
    reward that fails on one rank stops all of them instead of leaving the others in a collective."""
    rewards, failure = [], None
    try:
        for i, (example, group) in enumerate(zip(examples, answers)):
            for j, read in enumerate(group):
                if isinstance(read, Episode):  # an episode reward: the whole episode, as it ran
                    text, shown = read, f"episode {j} (finish_reason {read.finish_reason!r})"
                else:
                    text = tokenizer.decode(read, skip_special_tokens=True)
                    shown = f"completion {j} {text[:60]!r}"
                where = f"grpo step {step}, prompt {i} of this rank's step{describe_sample(example)}, {shown}"
                rewards.append(reward_value(reward_fn(text, example), reward_fn, where))
    except Exception as err:  # raised below, once every rank knows
        failure = err
    if any_rank(failure is not None):
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"grpo step {step}: the reward failed on another rank (its error is in that rank's log); stopping here too"
        )
    return rewards


def set_advantages(rollouts: list[Rollout], rewards: torch.Tensor, step: int = 0, scale_rewards: str = "group") -> None:
    """Each rollout's group advantage from ``rewards`` ``(prompts, completions per prompt)``, in
    rollout order; a step whose groups all have equal rewards is said to train nothing.
    ``scale_rewards="batch"`` divides by the std of every rank's rewards (every rank calls this)."""
    batch_std = _global_std(rewards) if scale_rewards == "batch" else None
    if rewards.numel() and bool((rewards.std(dim=1) == 0).all()):
        logger.warning(
            "grpo step %d: every group's rewards are equal (all %s), so every advantage is 0 and this step "
            "does not change the model; give the completions room to answer (rollout.max_tokens), use "
            "larger groups (rollout.num_generations) or a reward that separates them",
            step,
            sorted(set(rewards[:, 0].tolist())),
        )
    if not rewards.numel():
        return
    advantages = group_advantages(rewards, scale_rewards=scale_rewards, batch_std=batch_std)
    for r, a in zip(rollouts, advantages.flatten().tolist(), strict=True):
        r.advantage = a


def _global_std(rewards: torch.Tensor) -> float:
    """The (Bessel-corrected) std of the rewards of all ranks, as TRL's ``scale_rewards="batch"``."""
    n, total = global_sum(rewards.numel()), global_sum(float(rewards.sum()))
    squares = global_sum(float((rewards.double() ** 2).sum()))
    return max(squares - total * total / n, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5 if n else 0.0


def train_on_rollouts(
    stepper: OptimizerStepper,
    rollouts: list[Rollout],
    loss: GRPOStepConfig,
    *,
    temperature: float = 1.0,
    ref_model=None,
    step: int | None = None,
) -> dict:
    """Packed training forwards and backwards over ``rollouts`` (with their advantages):
    ``loss.num_iterations`` passes of ``loss.steps_per_generation`` mini-batches, one optimizer step
    each; every rank calls it, also with no rollouts. Returns the step's training metrics.
    ``temperature``: what the rollouts were sampled at (``loss.logprobs="tempered"`` trains
    ``softmax(logits / temperature)``; their ``gen_logprobs`` must be under that policy).
    ``step`` names the step when its loss or gradient is not finite."""
    model = stepper.model
    model.train()
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    chunks = minibatches(rollouts, loss.steps_per_generation)
    scored_at = policy_temperature(loss.logprobs, temperature)
    batches = [MiniBatch(rollouts, chunk, loss, scored_at) for chunk in chunks]
    real = [row for b in batches for row in b.rows if not row.empty]
    packed = packing_metrics(real, rollouts)
    passes = loss.num_iterations * loss.steps_per_generation
    forwards_before = 0
    if loss.old_logprobs == "recompute" and passes > 1:  # the trainer's, once, before any update
        forwards_before = sum(len(b.rows) for b in batches)
        with torch.no_grad(), batch_invariant(loss.batch_invariant):
            for b in batches:
                b.old = [packed_logprobs(model, row.to(device), b.temperature) for row in b.rows]
    policy = make_policy_loss(loss.policy)
    acc = StepMetrics()
    label = None if step is None else f"grpo step {step}"
    for iteration in range(loss.num_iterations):
        for index, b in enumerate(batches):
            first = iteration == 0 and index == 0
            acc.grad_norms.append(
                train_window(
                    stepper, b, policy, loss, ref_model, device, acc, label, first=first, measure=iteration == 0
                )
            )
    train_time = time.perf_counter() - t0
    train_lp, gen_lp = acc.logps()
    gap, ratio = (train_lp - gen_lp).abs(), torch.exp(train_lp - gen_lp)
    # the model's tokens: an episode's tool tokens are context, not trained on
    completion_tokens = sum(r.num_loss_tokens for r in rollouts)
    longest = max((len(r.prompt_ids) + len(r.completion_ids) for r in rollouts), default=0)
    return {
        "loss": sum(acc.losses) / len(acc.losses),  # the mean over the step's optimizer steps
        "grad_norm": sum(acc.grad_norms) / len(acc.grad_norms),
        # tokens whose ratio left [1 - epsilon, 1 + epsilon_high] on the side the advantage pushes
        "clip_fraction": acc.sums.get("clip_ratio/region_mean", 0.0) / max(acc.tokens, 1.0),
        **{k: v / max(acc.tokens, 1.0) for k, v in acc.sums.items() if not k.startswith("is/")},
        "completion_tokens": completion_tokens,
        **packed,  # train_tokens, flat_train_tokens, tree_token_saving
        "train_rows": len(real),
        "padded_train_tokens": longest * len(rollouts),  # what one right-padded batch would compute
        "train_tokens_per_s": packed["train_tokens"] * passes / train_time,
        "optimizer_steps": passes,
        "forwards_per_optimizer_step": (forwards_before + acc.forwards) / passes,
        "ratio_dev_max_first_step": acc.first_ratio_dev,  # 0 in the mode: old = the rollout's, exactly
        "ratio_dev_max": acc.ratio_dev,  # |pi / pi_old - 1| over every step: moved by the updates alone
        "logprob_gap_max": float(gap.max()),
        "logprob_gap_mean": float(gap.mean()),
        # pi_train / pi_rollout before any update of this step: exactly 1 in batch-invariant mode
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
        **logprob_mismatch(train_lp, gen_lp),  # share outside [0.9, 1.1], p95 / max of |ratio - 1|
        **{f"mismatch/{k}": v for k, v in acc.sums.items() if k.startswith("is/")},
        "batch_invariant": float(loss.batch_invariant),
        "train_s": train_time,
    }
