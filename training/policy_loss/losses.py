"""The GRPO loss family, each as TRL 1.16's ``GRPOTrainer._compute_loss`` computes it (the formula in
each docstring; ``r`` the importance ratio, ``A`` the advantage, ``eps_l`` / ``eps_h`` the clip).

Where we differ from TRL, on purpose: one optimizer step is one window of packed rows, so the
token / sequence counts are the exact counts of that step over all ranks (TRL's ``dapo`` divides by
the generation batch's tokens spread evenly over its steps); ``bnpo`` is the token mean on each
rank's share of the step (TRL: of each micro-batch).
"""

from __future__ import annotations

import torch

from nopad.training.policy_loss.base import PolicyBatch, PolicyLoss, register


class ClippedLoss(PolicyLoss):
    """PPO's clipped surrogate: ``-min(r A, clip(r, 1 - eps_l, 1 + eps_h) A)``; with ``delta`` the
    unclipped ``r`` is capped at ``delta`` too (two-sided clipping)."""

    def per_token(self, b: PolicyBatch, ratio: torch.Tensor, metrics: dict) -> torch.Tensor:
        cfg = self.config
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.eps_high)
        self.clip_metrics(b, ratio.detach(), metrics)
        capped = ratio if cfg.delta is None else torch.clamp(ratio, max=cfg.delta)
        return -torch.minimum(capped * b.advantages, clipped * b.advantages)


@register
class GRPO(ClippedLoss):
    """``grpo``: each sequence's token mean, then the mean over sequences (length-biased)."""

    name = "grpo"
    normalizer = "sequences"
    per_sequence_mean = True


@register
class DrGRPO(ClippedLoss):
    """``dr_grpo``: the token sum over (sequences x ``max_completion_length``), a constant per
    sequence, so length does not reweight tokens (Dr. GRPO)."""

    name = "dr_grpo"
    normalizer = "sequences"
    uses = ClippedLoss.uses | {"max_completion_length"}

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if not config.max_completion_length or config.max_completion_length < 1:
            raise ValueError(
                "max_completion_length must be set for loss_type=dr_grpo, which divides by it "
                "(the recipe uses rollout.max_tokens)"
            )

    def aggregate(self, loss: torch.Tensor, b: PolicyBatch) -> torch.Tensor:
        return (loss * b.mask).sum() / self.config.max_completion_length


@register
class DAPO(ClippedLoss):
    """``dapo`` (TRL's default): the token mean over the whole step (all ranks)."""

    name = "dapo"


@register
class BNPO(ClippedLoss):
    """``bnpo``: the token mean over this rank's tokens of the step ("local batch")."""

    name = "bnpo"
    rank_local = True


@register
class GSPO(ClippedLoss):
    """``gspo``: the clipped loss on the sequence-level ratio ``exp(mean_t log r_t)`` (GSPO; TRL:
    ``importance_sampling_level="sequence"``), aggregated as ``grpo``."""

    name = "gspo"
    normalizer = "sequences"
    per_sequence_mean = True
    sequence_level = True
    uses = frozenset({"epsilon", "epsilon_high", "delta"})


@register
class CISPO(PolicyLoss):
    """``cispo``: ``-sg(min(r, eps_h)) A log pi`` (MiniMax-M1 / ScaleRL): the ratio, capped at
    ``epsilon_high`` and detached, weights a REINFORCE term; token mean over the step."""

    name = "cispo"
    uses = frozenset({"epsilon_high", "importance_sampling_level"})

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        if config.epsilon_high is None:
            raise ValueError("epsilon_high must be set for loss_type=cispo: it caps the ratio (ScaleRL recommends 5.0)")

    def per_token(self, b: PolicyBatch, ratio: torch.Tensor, metrics: dict) -> torch.Tensor:
        cap = self.config.epsilon_high
        metrics["cispo_clip_ratio"] = float((((ratio > cap) & (b.advantages > 0)) * b.mask).sum())
        return -torch.clamp(ratio, max=cap).detach() * b.advantages * b.logp


@register
class SAPO(PolicyLoss):
    """``sapo``: ``-sigmoid(tau (r - 1)) 4 / tau A`` with ``tau`` = ``sapo_temperature_pos`` where
    A > 0, else ``sapo_temperature_neg`` (soft gating, no hard clip); aggregated as ``grpo``."""

    name = "sapo"
    normalizer = "sequences"
    per_sequence_mean = True
    uses = frozenset({"sapo_temperature_pos", "sapo_temperature_neg", "importance_sampling_level"})

    def per_token(self, b: PolicyBatch, ratio: torch.Tensor, metrics: dict) -> torch.Tensor:
        cfg = self.config
        tau = torch.where(b.advantages > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * b.advantages
