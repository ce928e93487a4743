"""One GRPO step, owned here: prompts -> rollouts on the live weights -> rewards and group
advantages -> packed rows -> the training forward's log-probs -> the clipped token loss -> one
optimizer step (:class:`training.accumulation.OptimizerStepper`) -> the step's metrics.

The recipe (``recipes/grpo.py``) calls :func:`grpo_step`; code that already holds its rollouts
(tests, other samplers) calls :func:`train_on_rollouts`. ``NopadGRPOTrainer`` keeps TRL's loss
and step but packs and scores with the same :mod:`training.grpo` functions, and a test holds the
two steps to the same parameters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from inference.episodes import EpisodeLimits
from inference.sharded import sharded_generate
from inference.tools import ToolFormat
from packing.distributed import any_rank
from packing.invariance import batch_invariant
from training.accumulation import OptimizerStepper, pad_rows
from training.grpo import (
    ISWeightFn,
    Rollout,
    empty_rollout_row,
    group_advantages,
    grpo_token_loss,
    pack_rollouts,
    packed_logprobs,
    packing_metrics,
)
from training.mismatch import logprob_mismatch
from training.nonfinite import describe_sample, reward_value

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]


@dataclass
class GRPOLoss:
    """What turns rollouts into one step's loss: the packing, the clipped ratio, the KL term and an
    optional importance-sampling correction (``is_weights(train_logprobs, gen_logprobs)``)."""

    max_tokens_per_batch: int = 1024
    shared_prefix: bool = True  # rollouts packed as a prefix tree: shared prefixes computed once
    clip_eps: float = 0.2
    beta: float = 0.0
    is_weights: ISWeightFn | None = None
    batch_invariant: bool = False  # the forwards run in packing.batch_invariant() (already resolved)


def grpo_step(stepper: OptimizerStepper, generator, examples: Sequence[dict],
              prompt_ids: Sequence[list[int]], reward_fn: RewardFn, tokenizer, params, loss: GRPOLoss, *,
              step: int = 0, rollout_mode: str = "gather", ref_model=None, use_tqdm: bool = False,
              episodes: ToolEpisodes | None = None) -> dict:
    """One GRPO step on ``examples`` (their prompt token ids in ``prompt_ids``; ``params``: the
    generator's ``SamplingParams`` with ``n`` completions per prompt). Every rank calls it each step,
    also with no examples. ``episodes``: multi-turn tool rollouts, trained on the model's tokens
    only and rewarded on the last model turn. Returns the step's metrics."""
    t0 = time.perf_counter()
    episode_metrics = {}
    with batch_invariant(loss.batch_invariant):
        if episodes is None:
            outputs = sharded_generate(generator, stepper.model, list(prompt_ids), params, mode=rollout_mode,
                                       use_tqdm=use_tqdm)
            samples = [[(c.token_ids, c.token_ids, c.logprobs, ()) for c in out.outputs] for out in outputs]
        else:
            samples, episode_metrics = _run_episodes(generator, stepper.model, prompt_ids, params, episodes)
    rollout_time = time.perf_counter() - t0
    generator.release()  # the KV cache goes back before any backward pass
    rollouts = [Rollout(list(ids), list(completion), [float(x) for x in logprobs], loss_mask=list(mask))
                for ids, group in zip(prompt_ids, samples) for _, completion, logprobs, mask in group]
    answers = [[answer for answer, *_ in group] for group in samples]  # what each reward reads
    rewards = score_rollouts(reward_fn, tokenizer, examples, answers, step)
    rewards_t = torch.tensor(rewards).view(len(examples), params.n)
    set_advantages(rollouts, rewards_t, step)
    metrics = train_on_rollouts(stepper, rollouts, loss, ref_model=ref_model, step=step)
    completion_tokens = metrics["completion_tokens"]
    return {"step": step, "reward_mean": float(rewards_t.mean()), "reward_std": float(rewards_t.std()),
            **metrics, **episode_metrics, "rollout_tokens_per_s": completion_tokens / rollout_time,
            "rollout_s": rollout_time}


@dataclass
class ToolEpisodes:
    """Multi-turn rollouts (:meth:`inference.Generator.run_episodes`): the tools the model may call,
    how calls look in tokens (None: the chat template's) and the episode limits."""

    tools: Mapping[str, Callable]
    tool_format: ToolFormat | None = None
    limits: EpisodeLimits | None = None


def _run_episodes(generator, model, prompt_ids, params, episodes: ToolEpisodes):
    """Per prompt, per sample: (the last model turn: what the reward reads, the completion with the
    tool results, the raw log-probs, the loss mask), and the rollout's tool metrics."""
    from inference.sharded import sharded_weights

    if sharded_weights(model) is not None:
        raise ValueError("tool episodes run on an unsharded policy; FSDP2-sharded GRPO takes single-turn "
                         "tasks only (task.name without tools)")
    done = generator.run_episodes(list(prompt_ids), episodes.tools, params, limits=episodes.limits,
                                  tool_format=episodes.tool_format)
    samples = [[] for _ in prompt_ids]
    for ep in done:
        last = ep.turns[-1] if ep.turns else None
        answer = ep.completion_ids[last.start:last.end] if last is not None else []
        samples[ep.prompt_index].append((answer, ep.completion_ids, ep.logprobs, ep.model_mask))
    calls = sum(ep.num_tool_calls for ep in done)
    return samples, {"tool_calls_per_episode": calls / max(len(done), 1),
                     "tool_failure_rate": sum(ep.num_tool_errors for ep in done) / max(calls, 1),
                     "tool_turns_mean": sum(ep.num_turns for ep in done) / max(len(done), 1),
                     "tool_wait_s": float(generator.last_episode_stats.get("tool_wait_s", 0.0))}


def score_rollouts(reward_fn: RewardFn, tokenizer, examples: Sequence[dict],
                   answers: Sequence[Sequence[Sequence[int]]], step: int) -> list[float]:
    """Every completion's reward, in rollout order (``answers``: per prompt, per completion, the token
    ids the reward reads), each checked to be one finite number (an error
    names the reward, the step and the sample). Every rank joins one all-reduce after scoring, so a
    reward that fails on one rank stops all of them instead of leaving the others in a collective."""
    rewards, failure = [], None
    try:
        for i, (example, group) in enumerate(zip(examples, answers)):
            for j, token_ids in enumerate(group):
                text = tokenizer.decode(token_ids, skip_special_tokens=True)
                where = (f"grpo step {step}, prompt {i} of this rank's step{describe_sample(example)}, "
                         f"completion {j} {text[:60]!r}")
                rewards.append(reward_value(reward_fn(text, example), reward_fn, where))
    except Exception as err:  # raised below, once every rank knows
        failure = err
    if any_rank(failure is not None):
        if failure is not None:
            raise failure
        raise RuntimeError(f"grpo step {step}: the reward failed on another rank (its error is in that "
                           "rank's log); stopping here too")
    return rewards


def set_advantages(rollouts: list[Rollout], rewards: torch.Tensor, step: int = 0) -> None:
    """Each rollout's group advantage from ``rewards`` ``(prompts, completions per prompt)``, in
    rollout order; a step whose groups all have equal rewards is said to train nothing."""
    if rewards.numel() and bool((rewards.std(dim=1) == 0).all()):
        logger.warning(
            "grpo step %d: every group's rewards are equal (all %s), so every advantage is 0 and this step "
            "does not change the model; give the completions room to answer (rollout.max_tokens), use "
            "larger groups (rollout.num_generations) or a reward that separates them", step,
            sorted(set(rewards[:, 0].tolist())))
    if not rewards.numel():
        return
    for r, a in zip(rollouts, group_advantages(rewards).flatten().tolist(), strict=True):
        r.advantage = a


def train_on_rollouts(stepper: OptimizerStepper, rollouts: list[Rollout], loss: GRPOLoss, *,
                      ref_model=None, step: int | None = None) -> dict:
    """Packed training forward and backward over ``rollouts`` (with their advantages), one optimizer
    step; every rank calls it, also with no rollouts. Returns the training metrics of the step.
    ``step`` names the step when its loss or gradient is not finite."""
    model = stepper.model
    model.train()
    t0 = time.perf_counter()
    rows = pack_rollouts(rollouts, loss.max_tokens_per_batch, shared_prefix=loss.shared_prefix)
    packed = packing_metrics(rows, rollouts)
    # every rank the same number of rows: under ZeRO-3 / FSDP2 each forward is a collective
    rows = pad_rows(rows, empty_rollout_row)
    train_lps, gen_lps, losses, clipped = [], [], [], 0
    device = next(model.parameters()).device
    label = None if step is None else f"grpo step {step}"
    with stepper.window(rows, "num_loss_tokens", step=label) as window:
        for row in rows:
            row = row.to(device)  # CPU rows (and their VarlenMeta) to the model
            with window.row():
                loss_sum, logp, gen_lp, was_clipped = _row_loss(model, row, loss, ref_model)
                row_loss = window.backward(loss_sum)
            if not row.empty:
                train_lps.append(logp.detach())
                gen_lps.append(gen_lp)
                losses.append(row_loss)
                clipped += int(was_clipped.sum())
    rows = [r for r in rows if not r.empty]
    train_time = time.perf_counter() - t0
    train_lp = torch.cat(train_lps) if train_lps else torch.zeros(1)
    gen_lp = torch.cat(gen_lps) if gen_lps else torch.zeros(1)
    gap, ratio = (train_lp - gen_lp).abs(), torch.exp(train_lp - gen_lp)
    # the model's tokens: an episode's tool tokens are context, not trained on
    completion_tokens = sum(sum(r.loss_mask) if r.loss_mask else len(r.completion_ids) for r in rollouts)
    longest = max((len(r.prompt_ids) + len(r.completion_ids) for r in rollouts), default=0)
    return {
        "loss": float(torch.stack(losses).sum()) if losses else 0.0,
        "grad_norm": window.grad_norm,
        "clip_fraction": clipped / max(completion_tokens, 1),  # tokens whose ratio left [1-eps, 1+eps]
        "completion_tokens": completion_tokens,
        **packed,  # train_tokens, flat_train_tokens, tree_token_saving
        "train_rows": len(rows),
        "padded_train_tokens": longest * len(rollouts),  # what one right-padded batch would compute
        "train_tokens_per_s": packed["train_tokens"] / train_time,
        "logprob_gap_max": float(gap.max()),
        "logprob_gap_mean": float(gap.mean()),
        # pi_train / pi_rollout of this (first and only) epoch: exactly 1 in batch-invariant mode
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
        **logprob_mismatch(train_lp, gen_lp),  # share outside [0.9, 1.1], p95 / max of |ratio - 1|
        "batch_invariant": float(loss.batch_invariant),
        "train_s": train_time,
    }


def _row_loss(model, row, loss: GRPOLoss, ref_model):
    """The summed GRPO token loss of one packed row (zero for a padding row, which only runs the
    collectives); also its log-probs, the generator's and which tokens were clipped."""
    with batch_invariant(loss.batch_invariant):  # the forward only; any correct backward will do
        logp = packed_logprobs(model, row)
    gen_lp = row.gen_logprobs
    if gen_lp is None or gen_lp.shape != logp.shape:
        have = "no" if gen_lp is None else gen_lp.numel()
        raise ValueError(f"a row has {logp.numel()} loss tokens but {have} generator log-probs; the GRPO "
                         "loss needs every Rollout's gen_logprobs (the generator's, per sampled token)")
    gen_lp, adv = gen_lp.to(logp.device), row.advantages.to(logp.device)
    if loss.is_weights is None:
        old, weights = gen_lp, None  # ratio against the generator's own log-probs
    else:
        old, weights = logp.detach(), loss.is_weights(logp.detach(), gen_lp).detach()
    ref_lp = None
    if ref_model is not None and loss.beta:
        with torch.no_grad():
            ref_lp = packed_logprobs(ref_model, row)
    tok_loss, was_clipped = grpo_token_loss(logp, old, adv, loss.clip_eps, weights, ref_lp, loss.beta)
    total = tok_loss.sum()
    if row.empty:
        total = total * 0.0
    return total, logp, gen_lp, was_clipped
