"""Turn the pieces of one packed batch into one flat varlen row the model and the loss understand.

Labels follow the transformers convention (the model's loss shifts them by one): the label at
position ``t`` is the target of the logits at ``t - 1``. So every sequence's first label is
``IGNORE_INDEX``: otherwise the last token of one sequence would learn to predict the first token
of its neighbour.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nopad.dataloaders.dataset import document_lengths
from nopad.packing.row import IGNORE_INDEX, PackedRow
from nopad.packing.varlen import VarlenMeta


class PackedCollator:
    """Concatenate examples (``input_ids``, ``labels``, ``train`` as produced by
    :class:`~nopad.dataloaders.dataset.PackedDataset` or the streaming loader) into one
    :class:`~nopad.packing.row.PackedRow` (``input_ids``/``labels``/``position_ids`` ``(1, T)``,
    ``nopad_meta``, ``seq_lens``, ``indices`` = the source row of each sequence, and the loss
    token/sequence counts for global normalisation). An example of a pre-packed row also carries
    ``seq_lengths``: its documents become sequences of their own (positions restart, first label
    ignored), exactly as if they had been packed here; they share its index.

    ``pad_to_multiple_of`` appends one loss-free filler sequence so ``T`` falls on a multiple (fixed
    shapes for ``torch.compile``/CUDA graphs); the filler attends only to itself and is not in
    ``seq_lens``.
    """

    def __init__(self, pad_to_multiple_of: int | None = None, pad_token_id: int = 0):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict[str, Any]]) -> PackedRow:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        ids, labels, lens, indices = [], [], [], []
        for ex in examples:
            seq = np.asarray(ex["input_ids"], dtype=np.int64)
            if seq.size == 0:
                raise ValueError(f"example {ex.get('index')} has no tokens; drop empty rows before packing")
            lab = np.asarray(ex.get("labels", seq), dtype=np.int64).copy()
            if lab.shape != seq.shape:
                raise ValueError(f"example {ex.get('index')}: labels shape {lab.shape} != input_ids {seq.shape}")
            docs = document_lengths(ex, seq.size, f"example {ex.get('index')}")
            docs = [seq.size] if docs is None else docs.tolist()
            lab[np.cumsum([0] + docs[:-1])] = IGNORE_INDEX  # no document learns its neighbour's first token
            if not ex.get("train", True):
                lab[:] = IGNORE_INDEX
            ids.append(seq)
            labels.append(lab)
            lens += docs
            indices += [int(ex.get("index", -1))] * len(docs)
        meta_lens = list(lens)
        if self.pad_to_multiple_of:
            extra = -sum(lens) % self.pad_to_multiple_of
            if extra:
                ids.append(np.full(extra, self.pad_token_id, dtype=np.int64))
                labels.append(np.full(extra, IGNORE_INDEX, dtype=np.int64))
                meta_lens.append(extra)
        meta = VarlenMeta.from_lengths(meta_lens)
        return PackedRow.build(np.concatenate(ids), np.concatenate(labels), meta, seq_lens=lens, indices=indices)
