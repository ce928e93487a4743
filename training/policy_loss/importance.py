"""Importance-sampling correction of the rollout / trainer mismatch, TRL 1.16's four modes
(``vllm_importance_sampling_mode``): the ratio pi_old_trainer / pi_rollout per token, or per
sequence (the product over its tokens: the sum of the log differences, as TRL), then truncated to
``[clip_min, clip_max]`` (``*_truncate``) or set to 0 outside it (``*_mask``). The weight multiplies
each token's policy loss (not the KL) and carries no gradient.

In ``nopad.packing.batch_invariant()`` the rollout's log-probs equal the trainer's bitwise, so every
weight is exactly 1 and no token is touched; the report says so.
"""

from __future__ import annotations

import math

import torch

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    seq: torch.Tensor,
    num_seqs: int,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-pair weights and how many counted tokens / sequences the mode changed
    (``is/tokens_touched``, ``is/seqs_touched``: clamped or masked)."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; use one of {IS_MODES}")
    diff = torch.nan_to_num((old_logp - rollout_logp).detach() * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = torch.zeros(num_seqs, dtype=diff.dtype, device=diff.device).index_add(0, seq, diff)
    ratio = torch.exp(diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        weight = ratio.clamp(min=clip_min, max=clip_max)
    else:
        weight = ratio.masked_fill(outside, 0.0)
    if mode.startswith("sequence"):
        seqs_touched = float(outside.sum())
        weight, outside = weight[seq], outside[seq]
    else:
        hits = torch.zeros(num_seqs, device=seq.device).index_add(0, seq, (outside & (mask > 0)).float())
        seqs_touched = float((hits > 0).sum())
    tokens_touched = float((outside & (mask > 0)).sum())
    return weight, {"is/tokens_touched": tokens_touched, "is/seqs_touched": seqs_touched}
