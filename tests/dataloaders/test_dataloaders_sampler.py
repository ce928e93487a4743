import numpy as np
import pytest

from nopad.dataloaders.dataset import PackedItem
from nopad.dataloaders.sampler import PackedBatchSampler

LENGTHS = np.random.default_rng(0).integers(1, 60, size=200)


def _epoch(sampler):
    return [list(b) for b in sampler]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_sequence_once_per_epoch_equal_steps(ranks):
    samplers = [PackedBatchSampler(LENGTHS, 128, num_replicas=ranks, rank=r, seed=1) for r in range(ranks)]
    per_rank = [_epoch(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1
    seen = sorted(item.index for batches in per_rank for batch in batches for item in batch if item.train)
    assert seen == list(range(len(LENGTHS)))
    for batches in per_rank:
        for batch in batches:
            assert sum(item.length for item in batch) <= 128
            assert all(item.start == 0 and item.length == LENGTHS[item.index] for item in batch)
    stats = samplers[0].last_stats
    assert stats["sequences_dropped"] == 0 and stats["sequences_duplicated"] == 0
    assert stats["steps_per_rank"] == len(per_rank[0]) and stats["num_ranks"] == ranks
    assert stats["tokens"] == int(LENGTHS.sum())


def test_repacked_every_epoch_with_seed():
    s = PackedBatchSampler(LENGTHS, 128, seed=5)
    e0 = _epoch(s)
    s.set_epoch(1)
    e1 = _epoch(s)
    again = PackedBatchSampler(LENGTHS, 128, seed=5)
    assert _epoch(again) == e0 and e0 != e1


def test_overflow_error_truncate_split():
    lengths = [10, 300, 20]
    with pytest.raises(ValueError, match="300"):
        list(PackedBatchSampler(lengths, 128))
    truncated = [i for b in PackedBatchSampler(lengths, 128, overflow="truncate") for i in b]
    assert sorted(truncated) == [PackedItem(0, 0, 10), PackedItem(1, 0, 128), PackedItem(2, 0, 20)]
    s = PackedBatchSampler(lengths, 128, overflow="split")
    pieces = sorted(i for b in s for i in b)
    assert pieces == [
        PackedItem(0, 0, 10),
        PackedItem(1, 0, 128),
        PackedItem(1, 128, 128),
        PackedItem(1, 256, 44),
        PackedItem(2, 0, 20),
    ]
    assert s.last_stats["sequences_split"] == 1 and s.last_stats["sequences_dropped"] == 0


def test_fewer_sequences_than_ranks_duplicates_with_loss_masked():
    samplers = [PackedBatchSampler([5, 6], 128, num_replicas=3, rank=r) for r in range(3)]
    batches = [_epoch(s) for s in samplers]
    assert [len(b) for b in batches] == [1, 1, 1]
    trained = sorted(i.index for b in batches for i in b[0] if i.train)
    assert trained == [0, 1]
    assert samplers[0].last_stats["sequences_duplicated"] == 1


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        PackedBatchSampler([], 128)
    with pytest.raises(ValueError, match="rank 2"):
        PackedBatchSampler([1], 128, num_replicas=2, rank=2)
    s = PackedBatchSampler(LENGTHS, 128, seed=1)
    with pytest.raises(ValueError, match="tokens_per_batch=64"):
        s.load_state_dict(PackedBatchSampler(LENGTHS, 64, seed=1).state_dict())


# --------------------------------------------------------------------------- resume fingerprint
BASE = dict(
    num_replicas=2,
    rank=0,
    seed=1,
    shuffle=True,
    max_seqs_per_batch=None,
    overflow="error",
    steps_multiple_of=1,
    attention_cost=None,
)


@pytest.mark.parametrize(
    "field, lengths, budget, change",
    [
        ("lengths_digest", LENGTHS[::-1].copy(), 128, {}),  # other data, same row count
        ("num_sequences", LENGTHS[:-1], 128, {}),
        ("tokens_per_batch", LENGTHS, 64, {}),
        ("max_seqs_per_batch", LENGTHS, 128, {"max_seqs_per_batch": 3}),
        ("overflow", LENGTHS, 128, {"overflow": "truncate"}),
        ("shuffle", LENGTHS, 128, {"shuffle": False}),
        ("seed", LENGTHS, 128, {"seed": 2}),
        ("num_replicas", LENGTHS, 128, {"num_replicas": 3}),
        ("steps_multiple_of", LENGTHS, 128, {"steps_multiple_of": 2}),
        ("attention_cost", LENGTHS, 128, {"attention_cost": 0.5}),
    ],
)
def test_resume_under_another_plan_names_the_field_and_both_values(field, lengths, budget, change):
    saved = PackedBatchSampler(LENGTHS, 128, **BASE).state_dict()
    other = PackedBatchSampler(lengths, budget, **{**BASE, **change})
    with pytest.raises(ValueError, match=f"made with {field}=.* but this loader has {field}=") as err:
        other.load_state_dict(saved)
    assert "skipped or repeated" in str(err.value)
    same = PackedBatchSampler(LENGTHS, 128, **BASE)
    same.load_state_dict({**saved, "epoch": 3})
    assert same.epoch == 3


@pytest.mark.parametrize(
    "garbage", [None, {}, {"epoch": 0}, {"epoch": 0, "fingerprint": "x"}, {"epoch": 0, "fingerprint": {"seed": 1}}]
)
def test_garbage_state_is_a_clear_error(garbage):
    from nopad.dataloaders import packed_dataloader

    with pytest.raises(ValueError, match="state|fingerprint|checkpoint"):
        PackedBatchSampler(LENGTHS, 128, seed=1).load_state_dict(garbage)
    loader = packed_dataloader([{"input_ids": [1, 2]}], 8, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="not a PackedDataLoader state"):
        loader.load_state_dict({"sampler": garbage})
    with pytest.raises(ValueError, match="step="):
        loader.load_state_dict({**loader.state_dict(), "step": 99})
