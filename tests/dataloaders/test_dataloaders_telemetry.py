import logging

import numpy as np

from nopad.dataloaders.balance import balance_bins
from nopad.dataloaders.telemetry import epoch_stats, log_epoch_stats


class _PackStats:
    tokens_truncated = 7
    num_split = 0


def _stats():
    lengths = np.array([5, 4, 3])
    plan = balance_bins([np.array([0, 1]), np.array([2])], lengths, 4, seed=None, attention_cost=0.0)
    return epoch_stats(
        epoch=2,
        num_sequences=3,
        capacity=10,
        pack_stats=_PackStats(),
        plan=plan,
        item_lengths=lengths,
        item_indices=np.array([0, 1, 2]),
    )


def test_epoch_stats_pins_every_field():
    # 3 bins ([0], [1], [2] after one split) + 1 loss-masked repeat for 4 ranks
    stats = _stats()
    assert stats == {
        "epoch": 2,
        "unit": "sequences",
        "num_sequences": 3,
        "num_bins": 4,
        "steps_per_rank": 1,
        "num_ranks": 4,
        "tokens": 12,
        "efficiency": 12 / 40,
        "tokens_truncated": 7,
        "sequences_split": 0,
        "sequences_dropped": 0,
        "sequences_duplicated": 1,
        "bins_split_for_balance": 1,
        "rank_cost_skew": stats["rank_cost_skew"],
        "step_cost_skew": stats["step_cost_skew"],
        "worst_step_max_over_mean": 5 / 4.25,
        "mean_step_max_over_mean": 5 / 4.25,
        "pad_fraction": 1 - 12 / 40,
        "idle_fraction": stats["idle_fraction"],
    }
    assert stats["step_cost_skew"] == stats["rank_cost_skew"] == 5 / np.mean([5, 4, 3, 5])
    assert abs(stats["idle_fraction"] - (1 - 4.25 / 5)) < 1e-12  # the repeat costs time, trains nothing


def test_log_warns_about_repeats_on_rank_zero_only(caplog):
    with caplog.at_level(logging.INFO, logger="nopad.dataloaders"):
        log_epoch_stats(_stats(), rank=1)
        assert caplog.records == []
        log_epoch_stats(_stats(), rank=0)
    assert "efficiency 30.00%" in caplog.records[0].getMessage()
    assert caplog.records[1].levelno == logging.WARNING
    assert "1 sequences repeated" in caplog.records[1].getMessage()
    assert "every rank runs the same number of steps" in caplog.records[1].getMessage()


def test_a_dropped_empty_row_on_one_rank_is_called_empty_not_a_rank_repeat(caplog):
    stats = {**_stats(), "num_ranks": 1, "sequences_dropped": 1, "sequences_duplicated": 0}
    with caplog.at_level(logging.WARNING, logger="nopad.dataloaders"):
        log_epoch_stats(stats, rank=0)
    (record,) = caplog.records
    assert "1 empty (zero-length) sequences dropped" in record.getMessage()
    assert "rank" not in record.getMessage()
