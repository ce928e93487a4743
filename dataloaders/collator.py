"""Turn the pieces of one packed batch into one flat varlen row the model and the loss understand.

Labels follow the transformers convention (the model's loss shifts them by one): the label at
position ``t`` is the target of the logits at ``t - 1``. So every sequence's first label is -100:
otherwise the last token of one sequence would learn to predict the first token of its neighbour.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dataloaders.dataset import document_lengths
from packing.varlen import VarlenMeta

IGNORE_INDEX = -100


class PackedCollator:
    """Concatenate examples (``input_ids``, ``labels``, ``train`` as produced by
    :class:`~dataloaders.dataset.PackedDataset` or the streaming loader) into a batch dict.
    An example of a pre-packed row also carries ``seq_lengths``: its documents become sequences of
    their own (positions restart, first label -100), exactly as if they had been packed here.

    - ``input_ids``, ``labels``, ``position_ids``: ``(1, T)`` int64
    - ``nopad_meta``: the :class:`~packing.varlen.VarlenMeta` of the row
    - ``seq_lens``: int64 ``[num_seqs]``; ``indices``: source row of each sequence (documents of
      one pre-packed row share its index)
    - ``num_loss_tokens`` / ``num_loss_seqs``: how many labels (and sequences with at least one
      label) this batch contributes, for global loss normalisation.

    ``pad_to_multiple_of`` appends one loss-free filler sequence so ``T`` falls on a multiple (fixed
    shapes for ``torch.compile``/CUDA graphs); the filler attends only to itself.
    """

    def __init__(self, pad_to_multiple_of: int | None = None, pad_token_id: int = 0):
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        ids, labels, lens, indices = [], [], [], []
        for ex in examples:
            seq = np.asarray(ex["input_ids"], dtype=np.int64)
            if seq.size == 0:
                raise ValueError(f"example {ex.get('index')} has no tokens; drop empty rows before packing")
            lab = np.asarray(ex.get("labels", seq), dtype=np.int64).copy()
            if lab.shape != seq.shape:
                raise ValueError(
                    f"example {ex.get('index')}: labels shape {lab.shape} != input_ids {seq.shape}"
                )
            docs = document_lengths(ex, seq.size, f"example {ex.get('index')}")
            docs = [seq.size] if docs is None else docs.tolist()
            starts = np.cumsum([0] + docs[:-1])
            lab[starts] = IGNORE_INDEX  # no document learns to predict its neighbour's first token
            if not ex.get("train", True):
                lab[:] = IGNORE_INDEX
            ids.append(seq)
            for start, n in zip(starts, docs):
                labels.append(lab[start : start + n])
                lens.append(n)
                indices.append(int(ex.get("index", -1)))
        num_loss_tokens = int(sum((lab != IGNORE_INDEX).sum() for lab in labels))
        num_loss_seqs = int(sum(bool((lab != IGNORE_INDEX).any()) for lab in labels))
        meta_lens = list(lens)
        if self.pad_to_multiple_of:
            extra = -sum(lens) % self.pad_to_multiple_of
            if extra:
                ids.append(np.full(extra, self.pad_token_id, dtype=np.int64))
                labels.append(np.full(extra, IGNORE_INDEX, dtype=np.int64))
                meta_lens.append(extra)
        meta = VarlenMeta.from_lengths(meta_lens)
        return {
            "input_ids": torch.from_numpy(np.concatenate(ids))[None],
            "labels": torch.from_numpy(np.concatenate(labels))[None],
            "position_ids": meta.position_ids[None],
            "nopad_meta": meta,
            "seq_lens": torch.tensor(lens, dtype=torch.int64),
            "indices": torch.tensor(indices, dtype=torch.int64),
            "num_loss_tokens": num_loss_tokens,
            "num_loss_seqs": num_loss_seqs,
        }
