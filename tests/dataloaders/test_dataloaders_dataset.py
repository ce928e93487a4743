import datasets
import numpy as np
import pytest

from nopad.dataloaders.dataset import PackedDataset, PackedItem


def test_rows_pieces_and_masks_from_an_hf_dataset():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3, 4], [5, 6]], "completion_mask": [[0, 0, 1, 1], [1, 1]]})
    packed = PackedDataset(ds)
    assert packed.lengths.tolist() == [4, 2] and packed.mask_column == "completion_mask"
    rows = packed.__getitems__([PackedItem(0, 1, 3), PackedItem(1, 0, 2, train=False)])
    assert rows[0]["input_ids"].tolist() == [2, 3, 4] and rows[0]["labels"].tolist() == [-100, 3, 4]
    assert rows[1]["index"] == 1 and rows[1]["train"] is False
    assert packed[1]["input_ids"].tolist() == [5, 6]


def test_list_of_dicts_with_labels_column():
    packed = PackedDataset([{"input_ids": [1, 2], "labels": [-100, 2]}])
    assert packed.label_column == "labels" and packed[0]["labels"].tolist() == [-100, 2]


def test_lengths_follow_select_and_shuffle():
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 1, 4, 1, 5)]})
    assert PackedDataset(ds.select([4, 0])).lengths.tolist() == [5, 3]
    shuffled = ds.shuffle(seed=0)
    assert PackedDataset(shuffled).lengths.tolist() == [len(x) for x in shuffled["input_ids"]]


def test_length_column_is_used():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "length": [3]})
    assert PackedDataset(ds).lengths.tolist() == [3]


def test_bad_inputs_say_what_to_do():
    with pytest.raises(ValueError, match="empty"):
        PackedDataset([])
    with pytest.raises(KeyError, match="no 'input_ids' column.*tokenize"):
        PackedDataset(datasets.Dataset.from_dict({"text": ["hi"]}))
    with pytest.raises(TypeError, match="DatasetDict"):
        PackedDataset(datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1]]})}))
    with pytest.raises(ValueError, match="2 lengths"):
        PackedDataset([{"input_ids": [1]}], lengths=np.array([1, 1]))
    with pytest.raises(ValueError, match="length was given"):
        PackedDataset([{"input_ids": [1, 2]}], lengths=[3])[0]
