"""A DataLoader over packed batches that can be checkpointed and resumed exactly.

Packing happens in the main process (in the batch sampler); worker processes only fetch and
collate the pieces they are handed. So the whole position of the loader is (epoch, batches
consumed), counted where the batches reach the caller: resuming replays the same plan and skips
what was consumed, whatever the number of workers or how far they had prefetched.

Accelerate: the loader shards by itself (the sampler knows ``num_replicas`` and ``rank``). Do not
pass it to ``accelerator.prepare`` - that would shard it a second time; move batches with
``row.to(device)`` (:meth:`nopad.packing.row.PackedRow.to`, which ``accelerate.utils.send_to_device``
calls too). :meth:`PackedDataLoader.state_dict`
is what ``accelerator.register_for_checkpointing`` needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.dataset import PackedDataset
from nopad.dataloaders.sampler import PackedBatchSampler
from nopad.packing.row import PackedRow, as_row


class PackedDataLoader(DataLoader):
    """``DataLoader(dataset, batch_sampler=PackedBatchSampler, collate_fn=PackedCollator)`` with
    ``state_dict()``/``load_state_dict()`` in the torchdata ``StatefulDataLoader`` style.

    Iterating runs the current epoch (from the resumed step if a state was loaded) and then moves
    to the next epoch, so ``for epoch in range(n): for batch in loader: ...`` just works.
    """

    def __init__(self, dataset: PackedDataset, batch_sampler: PackedBatchSampler, **kwargs: Any):
        kwargs.setdefault("collate_fn", PackedCollator())
        for forbidden in ("batch_size", "shuffle", "sampler", "drop_last"):
            value = kwargs.get(forbidden)
            if value not in (None, False) and not (forbidden == "batch_size" and value == 1):
                raise ValueError(f"{forbidden}= is decided by the PackedBatchSampler; do not pass it")
            kwargs.pop(forbidden, None)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self._step = 0  # batches of the current epoch handed to the caller

    @property
    def packed_sampler(self) -> PackedBatchSampler:
        return self.batch_sampler

    @property
    def epoch(self) -> int:
        return self.packed_sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.packed_sampler.set_epoch(epoch)
        self._step = 0

    def __iter__(self) -> Iterator[PackedRow]:
        sampler = self.packed_sampler
        sampler.start_step = self._step
        for batch in super().__iter__():
            self._step += 1
            yield batch
        sampler.set_epoch(sampler.epoch + 1)
        self._step = 0

    def __len__(self) -> int:
        return len(self.packed_sampler)

    def state_dict(self) -> dict:
        return {"step": self._step, "sampler": self.packed_sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "sampler" not in state or "step" not in state:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a PackedDataLoader state (expected 'step' and 'sampler', got {keys}); "
                "pass what PackedDataLoader.state_dict() returned"
            )
        self.packed_sampler.load_state_dict(state["sampler"])
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= len(self):
            raise ValueError(f"loader state step={step!r} is outside this epoch's 0..{len(self)} batches")
        self._step = step


def packed_dataloader(
    dataset: Any,
    tokens_per_batch: int,
    *,
    lengths: Sequence[int] | np.ndarray | None = None,
    num_replicas: int | None = None,
    rank: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    max_seqs_per_batch: int | None = None,
    overflow: str = "error",
    steps_multiple_of: int = 1,
    attention_cost: float | None = None,
    pad_to_multiple_of: int | None = None,
    num_workers: int = 0,
    **loader_kwargs: Any,
) -> PackedDataLoader:
    """The usual way in: a tokenized dataset -> a resumable loader of packed varlen batches for
    this data-parallel rank (taken from ``torch.distributed`` unless given)."""
    packed = dataset if isinstance(dataset, PackedDataset) else PackedDataset(dataset, lengths)
    sampler = PackedBatchSampler(
        packed.lengths,
        tokens_per_batch,
        num_replicas=num_replicas,
        rank=rank,
        seed=seed,
        shuffle=shuffle,
        max_seqs_per_batch=max_seqs_per_batch,
        overflow=overflow,
        steps_multiple_of=steps_multiple_of,
        attention_cost=attention_cost,
        unit="pre-packed rows" if packed.prepacked else "sequences",
    )
    return PackedDataLoader(
        packed,
        sampler,
        collate_fn=PackedCollator(pad_to_multiple_of=pad_to_multiple_of),
        num_workers=num_workers,
        **loader_kwargs,
    )


def move_batch(batch: Mapping[str, Any], device: torch.device | str, non_blocking: bool = False) -> PackedRow:
    """``PackedRow.to`` for code written against dict batches: a dict with the row's keys becomes
    the :class:`~nopad.packing.row.PackedRow` it describes, then moves."""
    return as_row(batch).to(device, non_blocking=non_blocking)
