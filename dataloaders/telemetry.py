"""Per-epoch packing statistics: one flat dict, logged once per epoch and kept on the sampler
(``sampler.last_stats``) so training scripts can log it to their tracker."""

from __future__ import annotations

import logging

import numpy as np

from nopad.dataloaders.balance import RankPlan

logger = logging.getLogger("nopad.dataloaders")


def epoch_stats(
    *,
    epoch: int,
    num_sequences: int,
    capacity: int,
    pack_stats,
    plan: RankPlan,
    item_lengths: np.ndarray,
    item_indices: np.ndarray,
    unit: str = "sequences",
) -> dict:
    """What an epoch's packing did. ``efficiency`` is real tokens / (bins x capacity) after the
    bins were split or duplicated for rank balance; a duplicated bin's tokens count as padding."""
    trained_bins = [b for i, b in enumerate(plan.bins) if i not in plan.duplicated]
    tokens = int(sum(int(item_lengths[b].sum()) for b in trained_bins))
    pieces = np.concatenate(trained_bins) if trained_bins else np.zeros(0, dtype=np.int64)
    seen = int(np.unique(np.asarray(item_indices)[pieces]).size)
    return {
        "epoch": int(epoch),
        "unit": unit,
        "num_sequences": int(num_sequences),
        "num_bins": len(plan.bins),
        "steps_per_rank": plan.num_steps,
        "num_ranks": len(plan.steps[0]) if plan.steps else 0,
        "tokens": tokens,
        "efficiency": tokens / (len(plan.bins) * capacity) if plan.bins else 0.0,
        "tokens_truncated": int(getattr(pack_stats, "tokens_truncated", 0) or 0),
        "sequences_split": int(getattr(pack_stats, "num_split", 0) or 0),
        "sequences_dropped": int(num_sequences - seen),
        "sequences_duplicated": int(sum(len(plan.bins[i]) for i in plan.duplicated)),
        "bins_split_for_balance": plan.bins_split,
        "rank_cost_skew": plan.rank_cost_skew,
        "step_cost_skew": plan.step_cost_skew,
        **{k: v for k, v in plan.step_report(capacity).items() if not k.startswith("step_")},
    }


def log_epoch_stats(stats: dict, rank: int = 0) -> None:
    """Log once (rank 0), and warn when data was dropped or duplicated."""
    if rank != 0:
        return
    logger.info(
        "epoch %d: %d %s -> %d bins, %d steps x %d ranks, efficiency %.2f%%, "
        "truncated %d tokens, split %d, rank cost skew %.3f, step cost skew %.3f "
        "(worst step max/mean %.3f), pad fraction %.3f",
        stats["epoch"],
        stats["num_sequences"],
        stats.get("unit", "sequences"),
        stats["num_bins"],
        stats["steps_per_rank"],
        stats["num_ranks"],
        100 * stats["efficiency"],
        stats["tokens_truncated"],
        stats["sequences_split"],
        stats["rank_cost_skew"],
        stats["step_cost_skew"],
        stats.get("worst_step_max_over_mean", 1.0),
        stats.get("pad_fraction", 0.0),
    )
    if stats["sequences_dropped"]:
        logger.warning(
            "epoch %d: %d empty (zero-length) sequences dropped: they have no tokens to train on",
            stats["epoch"],
            stats["sequences_dropped"],
        )
    if stats["sequences_duplicated"]:
        why = (
            "every rank runs the same number of steps"
            if stats["num_ranks"] > 1
            else "the epoch is a whole number of optimizer steps"
        )
        logger.warning(
            "epoch %d: %d sequences repeated (loss-masked) so that %s",
            stats["epoch"],
            stats["sequences_duplicated"],
            why,
        )
