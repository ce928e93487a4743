"""nopad.packing.pack_dataset on Hugging Face datasets: exact packed rows, overflow, formats, errors."""

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nopad.packing import pack_dataset

ROWS = {
    "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]],
    "labels": [[-100, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11], [12]],
    "text": ["a", "b", "c", "d"],
}


def test_pinned_rows_keep_labels_and_lengths():
    ds = datasets.Dataset.from_dict(ROWS)
    packed, bins = pack_dataset(ds, 6, position_ids=True, return_bins=True)
    assert [b.tolist() for b in bins] == [[2], [0, 1, 3]]
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "position_ids"]  # text dropped
    assert packed[:] == {
        "input_ids": [[6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 12]],
        "labels": [[6, 7, 8, 9, 10, 11], [-100, 2, 3, 4, 5, 12]],
        "seq_lengths": [[6], [3, 2, 1]],
        "position_ids": [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 0]],
    }


def test_split_and_truncate():
    ds = datasets.Dataset.from_dict(ROWS)
    assert pack_dataset(ds, 4, overflow="split", position_ids=True)[:] == {
        "input_ids": [[6, 7, 8, 9], [1, 2, 3, 12], [4, 5, 10, 11]],
        "labels": [[6, 7, 8, 9], [-100, 2, 3, 12], [4, 5, 10, 11]],
        "seq_lengths": [[4], [3, 1], [2, 2]],
        "position_ids": [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]],
    }
    assert pack_dataset(ds, 4, overflow="truncate", columns=["input_ids"])[:] == {
        "input_ids": [[6, 7, 8, 9], [1, 2, 3, 12], [4, 5]],
        "seq_lengths": [[4], [3, 1], [2]],
    }
    with pytest.raises(ValueError, match="sequence 2 has length 6 > capacity 4"):
        pack_dataset(ds, 4)


def test_selected_rows_format_and_dataset_dict():
    ds = datasets.Dataset.from_dict(ROWS).select([3, 2, 0])  # an indices mapping over the table
    assert pack_dataset(ds, 6, columns=["input_ids"])["input_ids"] == [[6, 7, 8, 9, 10, 11], [1, 2, 3, 12]]
    torch_ds = pack_dataset(ds.with_format("torch"), 6)
    assert torch_ds.format["type"] == "torch" and torch_ds[1]["input_ids"].tolist() == [1, 2, 3, 12]
    dd = pack_dataset(datasets.DatasetDict(train=ds, test=ds.select([0])), 6)
    assert dd["train"].num_rows == 2 and dd["test"]["seq_lengths"] == [[1]]


def test_boolean_mask_and_nulls_take_the_arrow_path():
    ds = datasets.Dataset.from_dict(
        {"input_ids": [[1, 2], [3], [4, 5, 6]], "loss_mask": [[True, False], [True], [False, True, True]]}
    )
    assert pack_dataset(ds, 4)[:] == {
        "input_ids": [[4, 5, 6, 3], [1, 2]],
        "loss_mask": [[False, True, True, True], [True, False]],
        "seq_lengths": [[3, 1], [2]],
    }


@pytest.mark.parametrize(
    "make, kwargs, error, message",
    [
        (lambda: {"input_ids": [[1]]}, {}, TypeError, "needs a datasets.Dataset or DatasetDict; got dict"),
        (lambda: datasets.Dataset.from_dict({"ids": [[1]]}), {}, ValueError, r"needs an 'input_ids' column"),
        (lambda: datasets.Dataset.from_dict({"input_ids": []}), {}, ValueError, "the dataset is empty"),
        (
            lambda: datasets.Dataset.from_dict({"input_ids": [[1, 2]], "labels": [[1]]}),
            {},
            ValueError,
            r"column 'labels' does not have one entry per token",
        ),
        (lambda: datasets.Dataset.from_dict(ROWS), {"columns": ["nope"]}, ValueError, r"\['nope'\] are not"),
        (lambda: datasets.Dataset.from_dict(ROWS), {"columns": ["text"]}, ValueError, r"'text' is not a"),
        (lambda: datasets.Dataset.from_dict({"input_ids": [[1], []]}), {}, ValueError, r"lengths\[1\] is 0"),
        (lambda: datasets.Dataset.from_dict({"input_ids": [[1], None]}), {}, ValueError, "row 1 has no"),
    ],
)
def test_bad_input(make, kwargs, error, message):
    with pytest.raises(error, match=message):
        pack_dataset(make(), 8, **kwargs)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=40), min_size=1, max_size=60),
    capacity=st.integers(8, 64),
    overflow=st.sampled_from(["truncate", "split"]),
    seed=st.one_of(st.none(), st.integers(0, 10)),
)
def test_packed_rows_are_the_binned_token_slices(rows, capacity, overflow, seed):
    ds = datasets.Dataset.from_dict({"input_ids": rows, "labels": [[-x for x in r] for r in rows]})
    packed, bins = pack_dataset(ds, capacity, overflow=overflow, seed=seed, return_bins=True)
    assert len(packed) == len(bins)
    for b, row in enumerate(packed):
        indices, starts, lengths = bins.items(b)
        expected = [t for i, s, n in zip(indices, starts, lengths) for t in rows[i][s : s + n]]
        assert row["input_ids"] == expected and row["labels"] == [-t for t in expected]
        assert row["seq_lengths"] == lengths.tolist() and len(expected) <= capacity


def test_at_least_as_dense_as_trl_global_bfd():
    trl_pack_dataset = pytest.importorskip("trl.data_utils").pack_dataset
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(60), 0.9, 3000), 1, 512).astype(int)
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in lengths]})
    ours = pack_dataset(ds, 512)
    theirs = trl_pack_dataset(ds, 512, "bfd", map_kwargs={"batch_size": len(ds)})
    assert len(ours) <= len(theirs)
    assert sum(map(sum, ours["seq_lengths"])) == sum(map(sum, theirs["seq_lengths"])) == lengths.sum()


def test_python_fallback_gives_the_same_rows(monkeypatch):
    ds = datasets.Dataset.from_dict(ROWS)
    expected = pack_dataset(ds, 4, overflow="split")[:]
    monkeypatch.setattr("nopad.packing.bins.hf_datasets.native_packer", lambda: None)
    assert pack_dataset(ds, 4, overflow="split")[:] == expected


def test_packed_rows_carry_no_attention_mask():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]})
    packed = pack_dataset(ds, 4)
    assert "attention_mask" not in packed.column_names and packed["seq_lengths"] == [[2, 1]]
    with pytest.raises(ValueError, match="cannot carry a concatenated attention_mask"):
        pack_dataset(ds, 4, columns=["attention_mask"])
