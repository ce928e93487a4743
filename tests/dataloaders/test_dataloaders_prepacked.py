"""Pre-packed datasets (nopad's ``pack_dataset``/``nopad.recipes.preprocess``, TRL's ``pack_dataset``):
the loaders and the collator read each row's own document boundaries, and the packed loss equals
the loss of every document run alone."""

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nopad import packing
from nopad.dataloaders import PackedCollator, StreamingPackedLoader, packed_dataloader
from nopad.dataloaders.dataset import document_lengths, slice_lengths
from tests.support.models import tiny_model

DOCS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15, 16], [17, 18]]  # 14 tokens


def _docs_dataset():
    labels = [[-100] + d[1:] for d in DOCS]  # a masked "prompt" token per doc
    return datasets.Dataset.from_dict({"input_ids": DOCS, "labels": labels})


def _only_batch(loader):
    (batch,) = list(loader)
    return batch


def _check_boundaries(batch):
    """Every document of every packed row is its own sequence: positions restart, first label -100."""
    lens = batch["seq_lens"].tolist()
    assert sorted(lens) == sorted(len(d) for d in DOCS)
    assert batch["nopad_meta"].cu_seqlens_q.tolist() == np.cumsum([0] + lens).tolist()
    pos = batch["position_ids"][0].tolist()
    assert pos == [p for n in lens for p in range(n)]
    starts = np.cumsum([0] + lens[:-1])
    assert (batch["labels"][0, starts] == -100).all()
    ids = batch["input_ids"][0].tolist()
    assert sorted(tuple(ids[s : s + n]) for s, n in zip(starts, lens)) == sorted(tuple(d) for d in DOCS)


def test_nopad_packed_rows_keep_their_documents_in_the_map_style_loader():
    packed = packing.pack_dataset(_docs_dataset(), 8)
    assert "seq_lengths" in packed.column_names and len(packed) == 2
    _check_boundaries(_only_batch(packed_dataloader(packed, 16, num_replicas=1, rank=0)))


def test_trl_packed_rows_keep_their_documents():
    from trl import pack_dataset as trl_pack

    ds = _docs_dataset().add_column("attention_mask", [[1] * len(d) for d in DOCS])
    trl = trl_pack(ds, 8, strategy="bfd")
    assert "seq_lengths" in trl.column_names
    _check_boundaries(_only_batch(packed_dataloader(trl, 16, num_replicas=1, rank=0)))


def test_position_ids_alone_give_the_boundaries():
    packed = packing.pack_dataset(_docs_dataset(), 8, position_ids=True).remove_columns("seq_lengths")
    _check_boundaries(_only_batch(packed_dataloader(packed, 16, num_replicas=1, rank=0)))


def test_streaming_loader_reads_packed_rows():
    packed = packing.pack_dataset(_docs_dataset(), 8)
    loader = StreamingPackedLoader(packed, 16, num_replicas=1, rank=0, buffer_size=4)
    _check_boundaries(_only_batch(loader))


def test_collator_reads_boundaries_of_raw_rows():
    row = {"input_ids": [1, 2, 3, 4, 5], "position_ids": [0, 1, 0, 1, 2]}
    batch = PackedCollator()([row])
    assert batch["seq_lens"].tolist() == [2, 3] and batch["labels"][0].tolist() == [-100, 2, -100, 4, 5]
    batch = PackedCollator()([{"input_ids": [1, 2, 3], "seq_lengths": [1, 2]}])
    assert batch["position_ids"][0].tolist() == [0, 0, 1] and batch["num_loss_seqs"] == 1


def test_split_and_truncated_packed_rows_cut_their_documents():
    assert slice_lengths(np.array([3, 2, 4]), 2, 5).tolist() == [1, 2, 2]
    packed = packing.pack_dataset(_docs_dataset(), 9)
    batches = list(packed_dataloader(packed, 4, num_replicas=1, rank=0, overflow="split", shuffle=False))
    for b in batches:
        assert b["seq_lens"].sum() == b["input_ids"].shape[1] <= 4
        assert b["position_ids"][0].tolist() == [p for n in b["seq_lens"].tolist() for p in range(n)]
    assert sum(int(b["seq_lens"].sum()) for b in batches) == sum(map(len, DOCS))


@pytest.mark.parametrize(
    "row, match",
    [
        ({"input_ids": [1, 2, 3], "seq_lengths": [2, 2]}, "do not add up to its 3 tokens"),
        ({"input_ids": [1, 2, 3], "position_ids": [0, 1]}, "one entry per token"),
        ({"input_ids": [1, 2, 3], "position_ids": [1, 2, 3]}, "start at 0"),
        ({"input_ids": [1, 2, 3], "position_ids": [0, 2, 3]}, "count up by 1"),
        ({"input_ids": [1, 2, 3, 4], "attention_mask": [1, 1, 2, 2]}, "document ids of a packed row"),
    ],
)
def test_a_row_that_looks_packed_without_usable_boundaries_is_an_error(row, match):
    with pytest.raises(ValueError, match=match):
        document_lengths(row, len(row["input_ids"]), "row 0")
    with pytest.raises(ValueError, match=match):
        list(packed_dataloader([row], 8, num_replicas=1, rank=0))
    with pytest.raises(ValueError, match=match):
        list(StreamingPackedLoader([row], 8, num_replicas=1, rank=0))
    with pytest.raises(ValueError, match=match):
        PackedCollator()([row])


def test_packed_loss_equals_each_document_run_alone():
    from nopad.packing.hf import register_nopad_attention

    register_nopad_attention()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 100, size=n).tolist() for n in (7, 12, 5, 9, 15, 3)]
    labels = [[-100] * 2 + d[2:] for d in docs]
    packed = packing.pack_dataset(datasets.Dataset.from_dict({"input_ids": docs, "labels": labels}), 24)
    assert len(packed) < len(docs)  # rows really hold several documents
    model = tiny_model("llama")
    with torch.no_grad():
        alone = sum(
            F.cross_entropy(
                model(input_ids=torch.tensor([d])).logits[0, :-1],
                torch.tensor(lab[1:]),
                ignore_index=-100,
                reduction="sum",
            ).item()
            for d, lab in zip(docs, labels)
        )
        model.set_attn_implementation("nopad")
        total, tokens = 0.0, 0
        for batch in packed_dataloader(packed, 24, num_replicas=1, rank=0):
            logits = model(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], nopad_meta=batch["nopad_meta"]
            ).logits[0, :-1]
            target = batch["labels"][0, 1:]
            total += F.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
            tokens += batch["num_loss_tokens"]
    assert tokens == sum(len(d) - 2 for d in docs)
    assert total == pytest.approx(alone, rel=1e-5)


def test_epoch_stats_call_prepacked_rows_rows(caplog):
    import logging

    from nopad.dataloaders import packed_dataloader

    rows = [{"input_ids": list(range(10)), "seq_lengths": [4, 6]}, {"input_ids": list(range(8)), "seq_lengths": [8]}]
    with caplog.at_level(logging.INFO, logger="nopad.dataloaders"):
        loader = packed_dataloader(rows, 16, num_replicas=1, rank=0)
        list(loader)
    assert loader.packed_sampler.last_stats["unit"] == "pre-packed rows"
    assert "2 pre-packed rows ->" in caplog.text
