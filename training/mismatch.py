"""How far the rollout's log-probs are from the trainer's, per model token: the report a user reads
when the batch-invariant mode is off (what TRL#6789 measures by hand). Both the GRPO recipe
(:func:`nopad.training.grpo_step.train_on_rollouts`) and ``NopadGRPOTrainer`` log it with their metrics.
"""

from __future__ import annotations

import torch

BAND = (0.9, 1.1)  # a token whose ratio leaves this band is counted as mismatched

KEYS = ("mismatch/outside_band", "mismatch/ratio_dev_p95", "mismatch/ratio_dev_max")


def logprob_mismatch(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """Per-token ratio ``exp(train_logp - rollout_logp)`` over the model tokens (``mask`` true;
    tool and padding tokens excluded), summarised as: ``mismatch/outside_band``, the share of
    tokens whose ratio is outside [0.9, 1.1]; ``mismatch/ratio_dev_p95`` and
    ``mismatch/ratio_dev_max``, the 95th percentile and the maximum of ``|ratio - 1|`` (all 0
    when the two sides agree bitwise, as in ``nopad.packing.batch_invariant()``). No token: all 0."""
    if train_logp.shape != rollout_logp.shape:
        raise ValueError(
            f"trainer log-probs {tuple(train_logp.shape)} and rollout log-probs "
            f"{tuple(rollout_logp.shape)} must have the same shape"
        )
    train, rollout = train_logp.detach().float(), rollout_logp.detach().float().to(train_logp.device)
    if mask is not None:
        if mask.shape != train.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must have the log-probs' shape {tuple(train.shape)}")
        keep = mask.to(train.device).bool()
        train, rollout = train[keep], rollout[keep]
    if not train.numel():
        return dict.fromkeys(KEYS, 0.0)
    ratio = torch.exp(train - rollout)
    dev = (ratio - 1).abs()
    outside = (ratio < BAND[0]) | (ratio > BAND[1])
    return {
        "mismatch/outside_band": float(outside.float().mean()),
        "mismatch/ratio_dev_p95": float(torch.quantile(dev, 0.95)),
        "mismatch/ratio_dev_max": float(dev.max()),
    }
