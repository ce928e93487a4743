"""The map-style side of packing: a tokenized dataset whose items the batch sampler addresses as
``(index, start, length)`` pieces, fetched in one go per packed batch.

The dataset itself does no packing: the sampler packs (in the main process) and the dataset only
fetches, so DataLoader workers are stateless and resuming is a matter of the sampler's position.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from torch.utils.data import Dataset

from nopad.packing.row import IGNORE_INDEX

logger = logging.getLogger(__name__)

# Columns that say which tokens are trained on, in order of preference. ``labels`` holds token ids
# with IGNORE_INDEX (-100) on ignored positions; the masks hold 1 where the token is trained (TRL's
# ``completion_mask``, transformers' ``assistant_masks`` from ``apply_chat_template``).
MASK_COLUMNS = ("completion_mask", "assistant_masks", "loss_mask")
# Columns that say where the documents of a pre-packed row begin (``nopad.packing.pack_dataset`` /
# ``nopad.recipes.preprocess`` and TRL's ``pack_dataset`` write ``seq_lengths``; TRL and
# ``pack_dataset(position_ids=True)`` may write ``position_ids``, restarting at 0 per document).
BOUNDARY_COLUMNS = ("seq_lengths", "position_ids")


def document_lengths(row: dict, num_tokens: int, where: str) -> np.ndarray | None:
    """Lengths of the documents of a pre-packed row, or ``None`` for a row that is one sequence.

    A row that looks packed but whose boundaries cannot be read is an error: training it as one
    sequence would let its documents attend to each other and continue each other's positions.
    """
    if row.get("seq_lengths") is not None:
        lengths = np.asarray(row["seq_lengths"], dtype=np.int64)
        if lengths.ndim != 1 or (lengths < 0).any() or int(lengths.sum()) != num_tokens:
            raise ValueError(
                f"{where}: seq_lengths {lengths.tolist()} do not add up to its {num_tokens} tokens; a packed "
                "row needs the lengths of its documents, in order (as nopad.packing.pack_dataset writes them)"
            )
        return lengths[lengths > 0]
    if row.get("position_ids") is not None:
        pos = np.asarray(row["position_ids"], dtype=np.int64).reshape(-1)
        continues = pos[1:] == pos[:-1] + 1
        if pos.size != num_tokens or (num_tokens and pos[0] != 0) or not (continues | (pos[1:] == 0)).all():
            raise ValueError(
                f"{where}: position_ids must have one entry per token, start at 0 and count up by 1 "
                "within each document, restarting at 0 at each new document; fix them or give seq_lengths"
            )
        starts = np.flatnonzero(pos == 0)
        return np.diff(np.append(starts, num_tokens))
    mask = row.get("attention_mask")
    if mask is not None and np.asarray(mask).size and int(np.max(mask)) > 1:
        raise ValueError(
            f"{where} has an attention_mask with values above 1 (document ids of a packed row), which nopad "
            "does not read as boundaries; re-pack with nopad.packing.pack_dataset / nopad.recipes.preprocess, or add "
            "a seq_lengths column"
        )
    return None


def slice_lengths(lengths: np.ndarray, start: int, length: int) -> np.ndarray:
    """The document lengths of tokens ``[start, start + length)`` of a row (a piece of a document
    cut by truncation or splitting becomes a document of its own)."""
    ends = np.cumsum(lengths)
    begins = ends - lengths
    cut = np.minimum(ends, start + length) - np.maximum(begins, start)
    return cut[cut > 0]


class PackedItem(NamedTuple):
    """One piece of one sequence in a packed batch. ``train=False`` marks a bin repeated only to
    give every rank the same number of steps: it runs but contributes no loss."""

    index: int
    start: int
    length: int
    train: bool = True


def _column_names(source: Any) -> list[str] | None:
    names = getattr(source, "column_names", None)
    if isinstance(names, dict):  # a DatasetDict: the user forgot to pick a split
        raise TypeError(f"got a DatasetDict with splits {list(names)}; pass one split, e.g. ds['train']")
    return list(names) if names is not None else None


def _arrow_list_lengths(source: Any, column: str) -> np.ndarray:
    """Lengths of a list column without turning a million rows into Python lists."""
    import pyarrow.compute as pc

    table = source.with_format("arrow")[:]  # honours select()/shuffle() index mappings
    return pc.list_value_length(table.column(column)).to_numpy(zero_copy_only=False)


class PackedDataset(Dataset):
    """Wrap a tokenized dataset (an HF ``datasets.Dataset``, a list of dicts, anything indexable
    with ``__len__``) whose rows have ``input_ids`` and optionally ``labels`` or a loss mask.

    ``lengths`` (one per row) may be given to skip computing them; otherwise a ``length`` column is
    used if present, else ``len(input_ids)`` of every row.
    """

    def __init__(self, source: Any, lengths: Sequence[int] | np.ndarray | None = None):
        if isinstance(source, Dataset) and isinstance(source, PackedDataset):
            source = source.source
        self.source = source
        if len(source) == 0:
            raise ValueError("the dataset is empty: there is nothing to pack")
        columns = _column_names(source)
        if columns is None:
            first = source[0]
            if not isinstance(first, dict):
                raise TypeError(f"dataset rows must be dicts with 'input_ids', got {type(first).__name__}")
            columns = list(first)
        if "input_ids" not in columns:
            raise KeyError(
                f"the dataset has no 'input_ids' column (columns: {columns}); tokenize it first, "
                "e.g. ds.map(lambda r: tokenizer(r['text']))"
            )
        self.label_column = "labels" if "labels" in columns else None
        self.mask_column = next((c for c in MASK_COLUMNS if c in columns), None)
        self.prepacked = any(c in columns for c in BOUNDARY_COLUMNS)  # each row holds documents
        self.lengths = self._lengths(source, columns, lengths)

    @staticmethod
    def _lengths(source: Any, columns: list[str], lengths) -> np.ndarray:
        if lengths is None and "length" in columns and _column_names(source) is not None:
            lengths = source["length"]
        if lengths is None:
            if _column_names(source) is not None:  # columnar (HF datasets): list lengths in Arrow
                lengths = _arrow_list_lengths(source, "input_ids")
            else:
                lengths = [len(row["input_ids"]) for row in source]
        arr = np.asarray(lengths, dtype=np.int64)
        if arr.shape != (len(source),):
            raise ValueError(f"got {arr.size} lengths for a dataset of {len(source)} rows")
        return arr

    def __len__(self) -> int:
        return len(self.source)

    def _row(self, index: int) -> dict:
        return self.source[int(index)]

    def _rows(self, indices: list[int]) -> list[dict]:
        if _column_names(self.source) is not None and hasattr(self.source, "select"):
            cols = self.source[indices]  # HF datasets: one columnar read per batch
            return [{k: v[i] for k, v in cols.items()} for i in range(len(indices))]
        return [self._row(i) for i in indices]

    def _piece(self, row: dict, item: PackedItem) -> dict:
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        if ids.shape[0] != self.lengths[item.index]:
            raise ValueError(
                f"row {item.index} has {ids.shape[0]} input_ids but its length was given as "
                f"{self.lengths[item.index]}; pass lengths that match the data"
            )
        sl = slice(item.start, item.start + item.length)
        labels = ids.copy()
        if self.label_column is not None:
            labels = np.asarray(row[self.label_column], dtype=np.int64)
        if self.mask_column is not None:
            mask = np.asarray(row[self.mask_column], dtype=bool)
            labels = np.where(mask, labels, IGNORE_INDEX)
        if labels.shape != ids.shape:
            raise ValueError(f"row {item.index}: labels/mask length {labels.shape[0]} != input_ids {ids.shape[0]}")
        piece = {"input_ids": ids[sl], "labels": labels[sl], "index": item.index, "train": item.train}
        docs = document_lengths(row, ids.shape[0], f"row {item.index}")
        if docs is not None:
            piece["seq_lengths"] = slice_lengths(docs, item.start, item.length)
        return piece

    def __getitem__(self, item: PackedItem | int) -> dict:
        if not isinstance(item, PackedItem):
            item = PackedItem(int(item), 0, int(self.lengths[int(item)]))
        return self._piece(self._row(item.index), item)

    def __getitems__(self, items: list[PackedItem]) -> list[dict]:
        """Fetch a whole packed batch at once (DataLoader calls this with the sampler's batch)."""
        items = [x if isinstance(x, PackedItem) else PackedItem(int(x), 0, int(self.lengths[int(x)])) for x in items]
        rows = self._rows([x.index for x in items])
        return [self._piece(row, x) for row, x in zip(rows, items)]
