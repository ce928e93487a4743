"""The policy loss's knobs, declared once: :class:`nopad.training.policy_loss.PolicyLossConfig` adds
dr_grpo's normaliser and the checks, and the GRPO recipe's ``loss`` section adds the two knobs its
step reads. No torch here, so a recipe's config and its ``--help`` read these without importing it;
the comment beside each default is the line ``--help`` and ``recipes/configs/grpo.yaml`` show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class PolicyLossSettings:
    """TRL 1.16 ``GRPOConfig``'s names and defaults (``is_*`` are TRL's
    ``vllm_importance_sampling_*``)."""

    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo | gspo | cispo | sapo (TRL's default: dapo)
    epsilon: float = 0.2  # lower clip of the ratio: 1 - epsilon
    epsilon_high: float | None = None  # upper clip 1 + epsilon_high (null: epsilon; DAPO 0.28; cispo: cap)
    delta: float | None = None  # two-sided clipping: the ratio capped at delta (INTELLECT-2); null: off
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's ratio
    beta: float = 0.0  # k3 KL against a frozen copy of the initial policy; 0: none
    use_bias_correction_kl: bool = True  # the KL term times the ratio (DeepSeek-V3.2), as TRL
    entropy_coef: float = 0.0  # minus entropy_coef x the mean token entropy
    sapo_temperature_pos: float = 1.0  # sapo: gate temperature where the advantage is > 0
    sapo_temperature_neg: float = 1.05  # sapo: where it is <= 0
    is_correction: str = "none"  # none | token_truncate | token_mask | sequence_truncate | sequence_mask
    is_clip_min: float | None = None  # IS correction: lower bound of the ratio (truncate) or mask edge
    is_clip_max: float | None = 3.0  # IS correction: upper bound

    def check_old_logprobs(self, old_logprobs: str, key: str = "old_logprobs") -> None:
        """IS correction weighs the trainer's old log-probs against the rollout's, so the step must
        recompute them (``old_logprobs``, named ``key`` where it is set): with the rollout's own every
        weight is 1 and the correction corrects nothing."""
        if self.is_correction != "none" and old_logprobs == "rollout":
            raise ValueError(
                f"is_correction {self.is_correction} weighs the trainer's old log-probs against "
                f"the rollout's, but {key}=rollout makes them the same numbers; set "
                f"{key}=recompute (or is_correction=none)"
            )
