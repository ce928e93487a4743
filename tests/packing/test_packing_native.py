"""The compiled packer (csrc/packer.cpp) against its pure-Python reference, and the fallback."""

import functools
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nopad.packing import _native, pack
from nopad.packing.bins import algorithms

native = pytest.importorskip("nopad.packing._packer", reason="compiled packer not built")


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=300),
    capacity=st.integers(64, 160),
    strategy=st.sampled_from(["bfd", "ffd", "nextfit"]),
    max_seqs=st.integers(0, 5),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
)
def test_native_equals_python_reference(lengths, capacity, strategy, max_seqs, seed):
    array = np.asarray(lengths, dtype=np.int64)
    if strategy == "nextfit":
        expected = algorithms.nextfit(array, capacity, max_seqs)
        got = native.nextfit(array, capacity, max_seqs)
    else:
        expected = getattr(algorithms, strategy)(array, capacity, max_seqs, seed)
        got = getattr(native, strategy)(array, capacity, max_seqs, seed)
    assert np.array_equal(expected[0], got[0])
    assert np.array_equal(expected[1], got[1])


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=100),
    capacity=st.integers(1, 128),
    seed=st.one_of(st.none(), st.integers(-5, 5)),
    overflow=st.sampled_from(["truncate", "split"]),
)
def test_pack_backends_agree(lengths, capacity, seed, overflow):
    a = pack(lengths, capacity, seed=seed, overflow=overflow, backend="python")
    b = pack(lengths, capacity, seed=seed, overflow=overflow, backend="native")
    for name in ("offsets", "indices", "starts", "lengths"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.stats == b.stats


def test_splitmix64_matches_reference_values():
    # splitmix64 from seed 0: the published first outputs.
    rng = algorithms.SplitMix64(0)
    assert [rng.next() for _ in range(2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_missing_extension_warns_once_and_falls_back(monkeypatch):
    _native.load_extension.cache_clear()
    monkeypatch.setattr(_native, "load_extension", functools.cache(_native.load_extension.__wrapped__))
    monkeypatch.setitem(sys.modules, "nopad.packing._packer", None)  # makes the import fail
    with pytest.warns(RuntimeWarning, match="compiled packer is not available.*pure-Python"):
        bins = pack([4, 8, 3, 5, 2], 10)
    assert [b.tolist() for b in bins] == [[1, 4], [3, 0], [2]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pack([4, 8], 10)  # no second warning
    with pytest.raises(RuntimeError, match="backend='native' but the compiled packer is not built"):
        pack([4, 8], 10, backend="native")


@settings(max_examples=50, deadline=None)
@given(
    src=st.binary(min_size=1, max_size=64),
    ranges=st.lists(st.tuples(st.integers(0, 63), st.integers(0, 10)), max_size=20),
)
def test_gather_bytes_equals_reference(src, ranges):
    src = np.frombuffer(src, dtype=np.uint8)
    ranges = [(s, min(n, len(src) - s)) for s, n in ranges if s < len(src)]
    starts = np.array([s for s, _ in ranges], dtype=np.int64)
    lengths = np.array([n for _, n in ranges], dtype=np.int64)
    expected = b"".join(src[s : s + n].tobytes() for s, n in ranges)
    assert native.gather_bytes(src, starts, lengths).tobytes() == expected
    assert algorithms.gather_bytes(src, starts, lengths).tobytes() == expected


def test_gather_bytes_rejects_out_of_range():
    src = np.zeros(4, dtype=np.uint8)
    with pytest.raises(IndexError, match="outside the source"):
        native.gather_bytes(src, np.array([2]), np.array([3]))
    with pytest.raises(IndexError, match="outside the source"):
        algorithms.gather_bytes(src, np.array([2]), np.array([3]))
