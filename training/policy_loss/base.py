"""The policy-loss seam: what every GRPO-family loss takes, what it returns, and the registry that
picks one by TRL's ``loss_type`` name.

Why a seam: the recipe (:mod:`nopad.training.grpo_step`) owns the forwards, the packing and the optimizer
step; a loss only turns per-pair log-probs and advantages into one row's summed loss. Adding a loss
is one class in :mod:`nopad.training.policy_loss.losses` and one :func:`register` line.

Everything is per *pair* (:class:`nopad.packing.row.PackedRow`): in a tree row a token that m rollouts
train on appears m times, each with its own rollout's advantage, so a shared token carries the
weight of the paths that train on it, as in TRL's padded batch where each path is its own row.
``seq`` names the rollout (sequence) of each pair, so sequence-level quantities (GSPO's ratio,
GRPO's per-sequence mean, sequence IS modes) are computed per path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from nopad.training.policy_loss.importance import IS_MODES, importance_weights
from nopad.training.policy_loss.settings import PolicyLossSettings


@dataclass
class PolicyLossConfig(PolicyLossSettings):
    """The knobs (:class:`PolicyLossSettings`: TRL 1.16 ``GRPOConfig``'s names and defaults) and
    ``max_completion_length``, dr_grpo's normaliser (TRL's generation length: a recipe passes its
    own). ``check()`` refuses what TRL would silently ignore."""

    max_completion_length: int | None = None  # dr_grpo's constant normaliser

    def __post_init__(self) -> None:
        self.check()

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def check(self) -> None:
        if self.loss_type not in LOSSES:
            raise ValueError(f"loss_type {self.loss_type!r} is unknown; use one of {sorted(LOSSES)}")
        if not self.epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon and self.loss_type != "cispo":
            raise ValueError(
                f"epsilon_high ({self.epsilon_high}) is below epsilon ({self.epsilon}): the upper "
                "clip would be tighter than the lower one; set epsilon_high >= epsilon (DAPO: 0.28)"
            )
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        for knob in ("beta", "entropy_coef"):
            if getattr(self, knob) < 0:
                raise ValueError(f"{knob} must be a number >= 0.0, got {getattr(self, knob)!r}")
        if self.is_correction not in ("none", *IS_MODES):
            raise ValueError(
                f"is_correction {self.is_correction!r} is unknown; use none or one of {', '.join(IS_MODES)}"
            )
        if self.delta is not None and not self.delta > 1:
            raise ValueError(
                f"delta must be > 1 (the ratio's cap; TRL recommends > 1 + epsilon_high), got "
                f"{self.delta}: a cap at or below 1 holds each on-policy ratio constant, "
                "so positive advantages train nothing"
            )
        for knob in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if not getattr(self, knob) > 0:
                raise ValueError(f"{knob} must be > 0 (sapo divides by it), got {getattr(self, knob)}")
        if self.is_correction == "none":
            idle = sorted({"is_clip_min", "is_clip_max"} & self.changed())
            if idle:
                raise ValueError(
                    f"{idle[0]} has no effect with is_correction=none; remove it or choose an "
                    f"is_correction mode ({', '.join(IS_MODES)})"
                )
        else:
            for knob in ("is_clip_min", "is_clip_max"):
                if getattr(self, knob) is not None and not getattr(self, knob) > 0:
                    raise ValueError(
                        f"{knob} must be > 0 or null (an importance ratio is positive), got {getattr(self, knob)}"
                    )
            if self.is_clip_min is None and self.is_clip_max is None:
                raise ValueError(
                    f"is_clip_max is null and so is is_clip_min: is_correction={self.is_correction} needs a bound"
                )
            if None not in (self.is_clip_min, self.is_clip_max) and self.is_clip_min >= self.is_clip_max:
                raise ValueError(f"is_clip_min ({self.is_clip_min}) must be below is_clip_max ({self.is_clip_max})")
        LOSSES[self.loss_type].check_config(self)

    def changed(self) -> set[str]:
        """The knobs set away from their defaults."""
        return {f.name for f in fields(self) if getattr(self, f.name) != f.default}


@dataclass
class PolicyBatch:
    """One row's loss pairs. ``logp`` carries the gradient; the rest are detached data."""

    logp: torch.Tensor  # [P] the policy's log-prob of each pair's token (the training forward)
    old_logp: torch.Tensor  # [P] the old policy's (the rollout's, or the trainer's before the updates)
    advantages: torch.Tensor  # [P] each pair's rollout advantage
    seq: torch.Tensor  # [P] int64: the sequence (rollout) of each pair, 0..num_seqs-1
    num_seqs: int
    mask: torch.Tensor | None = None  # [P] 0/1: pairs that count (0: a masked truncated completion)
    ref_logp: torch.Tensor | None = None  # [P] the reference model's (beta > 0)
    rollout_logp: torch.Tensor | None = None  # [P] the generator's (IS correction against old_logp)
    entropy: torch.Tensor | None = None  # [P] per-token entropy (entropy_coef > 0)

    def __post_init__(self) -> None:
        if self.mask is None:
            self.mask = torch.ones_like(self.logp)
        self.mask = self.mask.to(self.logp.dtype)


@dataclass
class PolicyLossOutput:
    """One row's loss as a *sum*: ``loss / count`` (``count``: the loss's ``normalizer`` summed over
    every row of the optimizer step on every rank) is the step's objective. ``entropy_sum`` is kept
    apart because the entropy bonus is always a token mean (:func:`objective` combines them).
    ``metrics`` are sums over the row's counted pairs (divide by ``tokens``)."""

    loss: torch.Tensor
    entropy_sum: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class PolicyLoss:
    """A GRPO-family loss. Subclasses give ``per_token`` (the per-pair loss before the KL, IS and
    aggregation) and say how the pairs are aggregated (``normalizer``: ``"tokens"`` or
    ``"sequences"``; ``per_sequence_mean``: each sequence's mean first, as TRL's ``grpo``)."""

    name = ""
    normalizer = "tokens"
    per_sequence_mean = False
    rank_local = False  # bnpo: normalised by this rank's tokens, not all ranks'
    sequence_level = False  # gspo: always the sequence-level ratio
    uses = frozenset({"epsilon", "epsilon_high", "delta", "importance_sampling_level"})

    def __init__(self, config: PolicyLossConfig):
        self.config = config

    @classmethod
    def check_config(cls, config: PolicyLossConfig) -> None:
        """A knob that does nothing with this loss is an error, not a silent no-op."""
        knobs = {
            "epsilon",
            "epsilon_high",
            "delta",
            "importance_sampling_level",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "max_completion_length",
        }
        idle = sorted((config.changed() & knobs) - cls.uses)
        if idle:
            raise ValueError(
                f"{idle[0]} has no effect with loss_type={cls.name}; remove it (it is read by {_readers(idle[0])})"
            )

    def log_ratio(self, b: PolicyBatch) -> torch.Tensor:
        """log(pi / pi_old) per pair, or GSPO's per sequence (the mean over its pairs, broadcast)."""
        lr = b.logp - b.old_logp
        if self.sequence_level or self.config.importance_sampling_level == "sequence":
            lr = seq_sum(lr * b.mask, b) / seq_sum(b.mask, b).clamp(min=1.0)
            lr = lr[b.seq]
        return lr

    def per_token(self, b: PolicyBatch, ratio: torch.Tensor, metrics: dict) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, b: PolicyBatch) -> PolicyLossOutput:
        cfg, metrics = self.config, {}
        ratio = torch.exp(self.log_ratio(b))
        loss = self.per_token(b, ratio, metrics)
        if cfg.is_correction != "none":
            if b.rollout_logp is None:
                raise ValueError("is_correction needs the rollout's log-probs (PolicyBatch.rollout_logp)")
            w, touched = importance_weights(
                b.old_logp,
                b.rollout_logp,
                b.mask,
                b.seq,
                b.num_seqs,
                cfg.is_correction,
                cfg.is_clip_min,
                cfg.is_clip_max,
            )
            loss = loss * w
            metrics.update(touched)
        if cfg.beta:
            if b.ref_logp is None:
                raise ValueError("beta > 0 needs the reference model's log-probs (PolicyBatch.ref_logp)")
            d = b.ref_logp - b.logp
            kl = torch.exp(d) - d - 1
            metrics["kl"] = float((kl.detach() * b.mask).sum())
            loss = loss + cfg.beta * (kl * ratio if cfg.use_bias_correction_kl else kl)
        out = PolicyLossOutput(self.aggregate(loss, b), metrics=metrics)
        if cfg.entropy_coef:
            if b.entropy is None:
                raise ValueError("entropy_coef > 0 needs the per-token entropy (PolicyBatch.entropy)")
            out.entropy_sum = (b.entropy * b.mask).sum()
        if b.entropy is not None:
            metrics["entropy"] = float((b.entropy.detach() * b.mask).sum())
        return out

    def aggregate(self, loss: torch.Tensor, b: PolicyBatch) -> torch.Tensor:
        if self.per_sequence_mean:  # TRL grpo / sapo: sum over sequences of each one's token mean
            return (seq_sum(loss * b.mask, b) / seq_sum(b.mask, b).clamp(min=1.0)).sum()
        return (loss * b.mask).sum()

    def clip_metrics(self, b: PolicyBatch, ratio: torch.Tensor, metrics: dict) -> None:
        """TRL's clip_ratio/low, /high and /region (sums over counted pairs)."""
        cfg, adv, m = self.config, b.advantages, b.mask
        low = (ratio < 1 - cfg.epsilon) & (adv < 0)
        high = (ratio > 1 + cfg.eps_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = float((low * m).sum())
        metrics["clip_ratio/high_mean"] = float((high * m).sum())
        metrics["clip_ratio/region_mean"] = float(((low | high) * m).sum())


def seq_sum(values: torch.Tensor, b: PolicyBatch) -> torch.Tensor:
    """Per-sequence sums of per-pair ``values``: ``[num_seqs]``."""
    return torch.zeros(b.num_seqs, dtype=values.dtype, device=values.device).index_add(0, b.seq, values)


def objective(out: PolicyLossOutput, config: PolicyLossConfig, count: float, tokens: float) -> torch.Tensor:
    """The row's summed loss in units of ``count`` (the loss's normaliser over the whole step), with
    the entropy bonus as a token mean over the step's ``tokens``: TRL's L_policy - coef * H."""
    loss = out.loss
    if config.entropy_coef and out.entropy_sum is not None:
        loss = loss - config.entropy_coef * out.entropy_sum * (count / max(tokens, 1.0))
    return loss


LOSSES: dict[str, type[PolicyLoss]] = {}


def register(cls: type[PolicyLoss]) -> type[PolicyLoss]:
    """Add a loss to the registry under its ``name`` (TRL's ``loss_type``)."""
    if cls.name in LOSSES:
        raise ValueError(f"a policy loss named {cls.name!r} is already registered")
    LOSSES[cls.name] = cls
    return cls


def make_policy_loss(config: PolicyLossConfig) -> PolicyLoss:
    return LOSSES[config.loss_type](config)


def _readers(knob: str) -> str:
    names = sorted(n for n, c in LOSSES.items() if knob in c.uses)
    return "loss_type " + " / ".join(names) if names else "no loss"


LossFn = Callable[[PolicyBatch], PolicyLossOutput]
