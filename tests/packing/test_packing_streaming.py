"""nopad.packing.StreamingPacker: pinned bins, invariants, exact resume from state_dict, quality."""

import copy
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nopad.packing import StreamingPacker, pack
from nopad.packing.bins.streaming import StreamItem


def keys(bins):
    return [[item.key for item in b] for b in bins]


def test_pinned_bins():
    sp = StreamingPacker(10, 3)
    assert sp.add(6, "a") == [] and sp.add(3, "b") == []
    # buffer full: longest (a, 6) starts the bin, then the longest that fits room 4 is b (3).
    assert sp.add(5, "c") == [[StreamItem("a", 6), StreamItem("b", 3)]]
    assert len(sp) == 1
    assert sp.add(4, "d") == []
    assert keys(sp.add(1, "e")) == [["c", "d", "e"]]
    assert sp.flush() == []
    assert (sp.num_added, sp.num_bins, sp.num_items_emitted, sp.num_tokens_emitted) == (5, 2, 5, 19)
    assert sp.efficiency == pytest.approx(19 / 20)
    assert repr(sp) == "StreamingPacker(capacity=10, buffer_size=3, buffered=0, bins=2, efficiency=95.00%)"


def test_default_keys_are_arrival_numbers_and_flush_packs_the_rest():
    sp = StreamingPacker(8, 100)
    for length in [5, 2, 7, 1, 3]:
        assert sp.add(length) == []
    assert keys(sp.flush()) == [[2, 3], [0, 4], [1]]


def test_overflow_modes():
    sp = StreamingPacker(4, 100, overflow="split")
    sp.add(10, "x")
    assert sorted(item for b in sp.flush() for item in b) == [
        StreamItem("x", 2, 8),
        StreamItem("x", 4, 0),
        StreamItem("x", 4, 4),
    ]
    assert sp.num_split == 1
    sp = StreamingPacker(4, 100, overflow="truncate")
    sp.add(10, "x")
    assert sp.flush() == [[StreamItem("x", 4)]]
    assert (sp.num_truncated, sp.tokens_truncated) == (1, 6)


@pytest.mark.parametrize(
    "kwargs, call, error, message",
    [
        ({}, lambda sp: sp.add(11, "k"), ValueError, r"sequence 'k' has length 11 > capacity 10"),
        ({}, lambda sp: sp.add(0, "k"), ValueError, r"sequence 'k' has length 0"),
        ({}, lambda sp: sp.add(2.5, "k"), TypeError, r"length must be an integer"),
    ],
)
def test_bad_add(kwargs, call, error, message):
    with pytest.raises(error, match=message):
        call(StreamingPacker(10, 4, **kwargs))


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 4), {}, r"capacity must be >= 1"),
        ((10, 0), {}, r"buffer_size must be >= 1"),
        ((10, 4), {"overflow": "drop"}, r"unknown overflow 'drop'"),
        ((10, 4), {"max_seqs_per_bin": 0}, r"max_seqs_per_bin must be >= 1"),
    ],
)
def test_bad_config(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StreamingPacker(*args, **kwargs)


def run(sp, lengths, start=0):
    bins = []
    for i, length in enumerate(lengths[start:], start):
        bins += sp.add(length, i)
    return bins + sp.flush()


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=200),
    capacity=st.integers(1, 64),
    buffer_size=st.integers(1, 40),
    max_seqs=st.one_of(st.none(), st.integers(1, 4)),
    seed=st.one_of(st.none(), st.integers(0, 100)),
)
def test_invariants(lengths, capacity, buffer_size, max_seqs, seed):
    sp = StreamingPacker(capacity, buffer_size, max_seqs_per_bin=max_seqs, seed=seed, overflow="split")
    bins = run(sp, lengths)
    assert all(sum(item.length for item in b) <= capacity for b in bins)
    if max_seqs:
        assert all(len(b) <= max_seqs for b in bins)
    pieces = sorted((item.key, item.start, item.length) for b in bins for item in b)
    expected = sorted(
        (i, s, min(capacity, length - s)) for i, length in enumerate(lengths) for s in range(0, length, capacity)
    )
    assert pieces == expected
    assert sp.num_tokens_emitted == sum(lengths) and len(sp) == 0


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=150),
    cut=st.floats(0, 1),
    seed=st.one_of(st.none(), st.integers(0, 100)),
)
def test_resume_from_state_dict_gives_the_same_bins(lengths, cut, seed):
    cut = int(cut * len(lengths))
    reference = run(StreamingPacker(64, 16, seed=seed), lengths)

    sp = StreamingPacker(64, 16, seed=seed)
    before = [b for i, length in enumerate(lengths[:cut]) for b in sp.add(length, i)]
    state = pickle.loads(pickle.dumps(sp.state_dict()))
    resumed = StreamingPacker(64, 16, seed=seed)
    resumed.load_state_dict(copy.deepcopy(state))
    after = run(resumed, lengths, start=cut)
    assert before + after == reference
    assert resumed.num_added == len(lengths)


def test_load_state_dict_checks_compatibility():
    state = StreamingPacker(64, 16).state_dict()
    with pytest.raises(ValueError, match="saved with capacity 64, this packer has 32"):
        StreamingPacker(32, 16).load_state_dict(state)
    with pytest.raises(ValueError, match="whether a seed is used"):
        StreamingPacker(64, 16, seed=1).load_state_dict(state)


def test_seed_changes_bins_but_is_reproducible():
    lengths = np.random.default_rng(0).integers(1, 20, size=400).tolist()
    a, b, c = (run(StreamingPacker(64, 50, seed=s), lengths) for s in (1, 1, 2))
    assert keys(a) == keys(b) and keys(a) != keys(c)


def test_quality_close_to_global_bfd():
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(350), 0.9, 20_000), 1, 4096).astype(int)
    sp = StreamingPacker(4096, 2000)
    run(sp, lengths.tolist())
    assert sp.efficiency > pack(lengths, 4096).stats.efficiency - 0.005
