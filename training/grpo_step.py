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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from inference.sharded import sharded_generate
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
)
from training.nonfinite import describe_sample, reward_value

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]


@dataclass
class GRPOLoss:
    """What turns rollouts into one step's loss: the packing, the clipped ratio, the KL term and an
    optional importance-sampling correction (``is_weights(train_logprobs, gen_logprobs)``)."""

    max_tokens_per_batch: int = 1024
    shared_prefix: bool = True
    clip_eps: float = 0.2
    beta: float = 0.0
    is_weights: ISWeightFn | None = None
    batch_invariant: bool = False  # the forwards run in packing.batch_invariant() (already resolved)


def grpo_step(stepper: OptimizerStepper, generator, examples: Sequence[dict],
              prompt_ids: Sequence[list[int]], reward_fn: RewardFn, tokenizer, params, loss: GRPOLoss, *,
              step: int = 0, rollout_mode: str = "gather", ref_model=None, use_tqdm: bool = False) -> dict:
    """One GRPO step on ``examples`` (their prompt token ids in ``prompt_ids``; ``params``: the
    generator's ``SamplingParams`` with ``n`` completions per prompt). Every rank calls it each step,
    also with no examples. Returns the step's metrics."""
    t0 = time.perf_counter()
    with batch_invariant(loss.batch_invariant):
        outputs = sharded_generate(generator, stepper.model, list(prompt_ids), params, mode=rollout_mode,
                                   use_tqdm=use_tqdm)
    rollout_time = time.perf_counter() - t0
    generator.release()  # the KV cache goes back before any backward pass
    rollouts = [Rollout(list(ids), list(c.token_ids), [float(x) for x in c.logprobs])
                for ids, out in zip(prompt_ids, outputs) for c in out.outputs]
    rewards = score_rollouts(reward_fn, tokenizer, examples, outputs, step)
    rewards_t = torch.tensor(rewards).view(len(examples), params.n)
    set_advantages(rollouts, rewards_t, step)
    metrics = train_on_rollouts(stepper, rollouts, loss, ref_model=ref_model, step=step)
    completion_tokens = metrics["completion_tokens"]
    return {"step": step, "reward_mean": float(rewards_t.mean()), "reward_std": float(rewards_t.std()),
            **metrics, "rollout_tokens_per_s": completion_tokens / rollout_time, "rollout_s": rollout_time}


def score_rollouts(reward_fn: RewardFn, tokenizer, examples: Sequence[dict], outputs,
                   step: int) -> list[float]:
    """Every completion's reward, in rollout order, each checked to be one finite number (an error
    names the reward, the step and the sample). Every rank joins one all-reduce after scoring, so a
    reward that fails on one rank stops all of them instead of leaving the others in a collective."""
    rewards, failure = [], None
    try:
        for i, (example, out) in enumerate(zip(examples, outputs)):
            for j, c in enumerate(out.outputs):
                text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
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
    # every rank the same number of rows: under ZeRO-3 / FSDP2 each forward is a collective
    rows = pad_rows(rows, empty_rollout_row)
    gaps, ratios, losses, clipped = [], [], [], 0
    device = next(model.parameters()).device
    label = None if step is None else f"grpo step {step}"
    with stepper.window(rows, "num_loss_tokens", step=label) as window:
        for row in rows:
            row = row.to(device)  # CPU rows (and their VarlenMeta) to the model
            with window.row():
                loss_sum, logp, gen_lp, was_clipped = _row_loss(model, row, loss, ref_model)
                row_loss = window.backward(loss_sum)
            if not row.empty:
                gaps.append((logp.detach() - gen_lp).abs())
                ratios.append(torch.exp(logp.detach() - gen_lp))
                losses.append(row_loss)
                clipped += int(was_clipped.sum())
    rows = [r for r in rows if not r.empty]
    train_time = time.perf_counter() - t0
    gap = torch.cat(gaps) if gaps else torch.zeros(1)
    ratio = torch.cat(ratios) if ratios else torch.ones(1)
    completion_tokens = sum(len(r.completion_ids) for r in rollouts)
    train_tokens = sum(int(r.input_ids.numel()) for r in rows)
    longest = max((len(r.prompt_ids) + len(r.completion_ids) for r in rollouts), default=0)
    return {
        "loss": float(torch.stack(losses).sum()) if losses else 0.0,
        "grad_norm": window.grad_norm,
        "clip_fraction": clipped / max(completion_tokens, 1),  # tokens whose ratio left [1-eps, 1+eps]
        "completion_tokens": completion_tokens,
        "train_tokens": train_tokens,
        "train_rows": len(rows),
        "padded_train_tokens": longest * len(rollouts),  # what one right-padded batch would compute
        "train_tokens_per_s": train_tokens / train_time,
        "logprob_gap_max": float(gap.max()),
        "logprob_gap_mean": float(gap.mean()),
        # pi_train / pi_rollout of this (first and only) epoch: exactly 1 in batch-invariant mode
        "is_ratio_min": float(ratio.min()),
        "is_ratio_max": float(ratio.max()),
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
