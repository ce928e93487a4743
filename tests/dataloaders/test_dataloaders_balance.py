import numpy as np
import pytest

from nopad.dataloaders.balance import balance_bins, bin_cost, default_attention_cost, equalize_bin_count, skew


def _bins(*groups):
    return [np.array(g, dtype=np.int64) for g in groups]


def test_every_rank_gets_the_same_number_of_steps_by_splitting():
    lengths = np.array([4, 4, 3, 3, 2, 2, 1])
    bins = _bins([0, 1], [2, 3], [4, 5, 6])  # 3 bins, 2 ranks -> one split, nothing duplicated
    plan = balance_bins(bins, lengths, 2, seed=None, attention_cost=0.0)
    assert plan.num_steps == 2 and len(plan.bins) == 4
    assert plan.bins_split == 1 and plan.duplicated == set()
    items = sorted(int(i) for step in plan.steps for b in step for i in plan.bins[b])
    assert items == list(range(7))  # every item exactly once


def test_split_halves_are_token_balanced():
    lengths = np.array([5, 4, 3, 2])
    bins, dup, splits = equalize_bin_count(_bins([0, 1, 2, 3]), lengths, 2, lambda x: float(x.sum()))
    assert splits == 1 and dup == set()
    assert [sorted(b.tolist()) for b in bins] == [[0, 3], [1, 2]]  # 7 and 7 tokens


def test_too_few_sequences_duplicates_and_reports():
    lengths = np.array([3])
    plan = balance_bins(_bins([0]), lengths, 4, seed=None)
    assert plan.num_steps == 1 and len(plan.bins) == 4
    assert plan.duplicated == {1, 2, 3}


def test_steps_multiple_of():
    lengths = np.ones(10, dtype=np.int64)
    bins = [np.array([i]) for i in range(9)] + [np.array([9])]
    plan = balance_bins(bins, lengths, 2, steps_multiple_of=3, seed=None)
    assert plan.num_steps == 6 and len(plan.duplicated) == 2  # 10 single-item bins -> 12


def test_steps_pair_bins_of_similar_cost():
    lengths = np.array([100, 100, 10, 10, 50, 50, 1, 1])
    bins = [np.array([i]) for i in range(8)]
    plan = balance_bins(bins, lengths, 2, seed=None, attention_cost=0.0)
    assert [sorted(lengths[[plan.bins[b][0] for b in s]].tolist()) for s in plan.steps] == [
        [100, 100],
        [50, 50],
        [10, 10],
        [1, 1],
    ]
    assert plan.step_cost_skew == 1.0 and plan.rank_cost_skew == 1.0


def test_seed_shuffles_step_order_deterministically():
    lengths = np.arange(1, 41)
    bins = [np.array([i]) for i in range(40)]
    a = balance_bins(bins, lengths, 4, seed=3)
    b = balance_bins(bins, lengths, 4, seed=3)
    c = balance_bins(bins, lengths, 4, seed=4)
    assert a.steps == b.steps and a.steps != c.steps


def test_cost_and_skew_helpers():
    assert bin_cost(np.array([2, 3]), 1.0, 0.5) == 5 + 0.5 * 13
    assert default_attention_cost(1) == pytest.approx(1 / 12)
    table = np.array([[1.0, 3.0], [2.0, 2.0]])
    assert skew(table) == (pytest.approx(5 / 4), pytest.approx(5 / 4))


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        balance_bins([], np.array([]), 2)
    with pytest.raises(ValueError, match="num_ranks"):
        balance_bins(_bins([0]), np.array([1]), 0)


def test_attention_cost_from_the_model_config():
    from nopad.dataloaders.balance import attention_cost_from_config
    from tests.support.models import tiny_config

    # d=64, 2 layers, 4 heads of 16, 2 kv heads, ffn 128, vocab 128: per token 2 * (2*64*8*16 +
    # 2*64*64 + 6*64*128) + 2*64*128 = 163840 FLOPs; attention 2 * 4*16 * 2 layers = 256 per l^2
    assert attention_cost_from_config(tiny_config("llama")) == 256 / 163840
    # a square dense decoder without LM head is the classic 1/(12 d)
    square = tiny_config("llama", num_key_value_heads=4, intermediate_size=3 * 64, vocab_size=0)
    linear = 2 * 64 * 12 * 16 + 2 * 64 * 64 + 6 * 64 * 192
    assert attention_cost_from_config(square) == 2 * 64 / linear
    assert attention_cost_from_config(tiny_config("llama", num_hidden_layers=8)) > 256 / 163840  # deeper


def test_step_report_max_over_mean_and_pad_fraction():
    lengths = np.array([6, 2, 4, 4])
    plan = balance_bins(_bins([0], [1], [2], [3]), lengths, 2, seed=None, attention_cost=0.0)
    report = plan.step_report(capacity=8)
    # sorted by cost: step 0 = bins of 6 and 4 tokens, step 1 = 4 and 2
    assert report["step_max_over_mean"] == [6 / 5, 4 / 3]
    assert report["step_pad_fraction"] == [1 - 10 / 16, 1 - 6 / 16]
    assert report["pad_fraction"] == 1 - 16 / 32
    assert report["worst_step_max_over_mean"] == 4 / 3
    assert report["idle_fraction"] == pytest.approx(1 - (5 + 3) / (6 + 4))
