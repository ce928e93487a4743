import numpy as np
import pytest
import torch

from nopad.dataloaders.collator import PackedCollator
from nopad.packing.row import IGNORE_INDEX


def test_flat_row_labels_and_metadata():
    batch = PackedCollator()(
        [
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "index": 4},  # prompt token masked
            {"input_ids": [8, 9], "index": 1},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    # first label of every sequence is ignored: 7 must not learn to predict 8
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["nopad_meta"].cu_seqlens_q.tolist() == [0, 3, 5]
    assert batch["seq_lens"].tolist() == [3, 2]
    assert batch["indices"].tolist() == [4, 1]
    assert batch["num_loss_tokens"] == 3 and batch["num_loss_seqs"] == 2


def test_duplicate_pieces_carry_no_loss():
    batch = PackedCollator()([{"input_ids": [1, 2, 3], "train": False}])
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3]
    assert batch["num_loss_tokens"] == 0 and batch["num_loss_seqs"] == 0


def test_pad_to_multiple_adds_a_loss_free_filler_sequence():
    batch = PackedCollator(pad_to_multiple_of=4, pad_token_id=0)([{"input_ids": np.array([3, 4, 5])}])
    assert batch["input_ids"].tolist() == [[3, 4, 5, 0]]
    assert batch["labels"].tolist() == [[-100, 4, 5, -100]]
    assert batch["nopad_meta"].seqlens_q == (3, 1)
    assert batch["seq_lens"].tolist() == [3]
    assert batch["input_ids"].dtype == torch.int64


def test_bad_examples():
    with pytest.raises(ValueError, match="empty batch"):
        PackedCollator()([])
    with pytest.raises(ValueError, match="no tokens"):
        PackedCollator()([{"input_ids": [], "index": 3}])
    with pytest.raises(ValueError, match="labels shape"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1]}])
