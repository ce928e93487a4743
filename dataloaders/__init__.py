"""Packed-batch data loading for Accelerate and DeepSpeed training, on the packing core.

The usual path: ``packed_dataloader(tokenized_dataset, tokens_per_batch)`` -> batches of one flat
varlen row each (a :class:`nopad.packing.row.PackedRow`: ``input_ids``, ``labels``, ``position_ids``,
``nopad_meta``, counts; ``row.to(device)``, ``model(**row.model_kwargs())``), sharded and
balanced over the data-parallel ranks by the loader itself, resumable with ``state_dict()``
(the step that normalises by its global loss-token count is ``nopad.training.OptimizerStepper``).
``StreamingPackedLoader`` does the same for streams.
"""

from nopad.dataloaders.balance import RankPlan, balance_bins
from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.dataset import PackedDataset, PackedItem
from nopad.dataloaders.loader import PackedDataLoader, move_batch, packed_dataloader
from nopad.dataloaders.sampler import PackedBatchSampler
from nopad.dataloaders.streaming import StreamingPackedLoader

__all__ = [
    "PackedBatchSampler",
    "PackedCollator",
    "PackedDataLoader",
    "PackedDataset",
    "PackedItem",
    "RankPlan",
    "StreamingPackedLoader",
    "balance_bins",
    "move_batch",
    "packed_dataloader",
]
