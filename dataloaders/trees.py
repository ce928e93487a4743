"""A resumable, rank-sharded loader of prefix-tree rows: sequences that share prefixes (the
per-turn samples of multi-turn chats, each with its own rendering of the history) trained with
every shared token computed once per row.

The sequences' trie (:mod:`nopad.packing.bins.tree`) is split once into pieces of at most the token
budget; the pieces are the items the usual :class:`~nopad.dataloaders.sampler.PackedBatchSampler` packs
into batches and balances over the ranks each epoch (shuffled per epoch, a whole number of
accumulation windows per rank, resumable), and :class:`TreeCollator` lays each batch's pieces as
one tree row (pieces of one tree that share a batch lay their common nodes once).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

from nopad.dataloaders.dataset import PackedItem
from nopad.dataloaders.loader import PackedDataLoader
from nopad.dataloaders.sampler import PackedBatchSampler
from nopad.packing.bins.tree import Piece, TreePath, build_trie, split_tree, tree_row
from nopad.packing.row import IGNORE_INDEX, PackedRow


class TreePieces(Dataset):
    """The pieces of the trie of ``paths`` for rows of ``capacity`` tokens; ``lengths`` are their
    tokens (ancestor paths repeated in a piece included)."""

    def __init__(self, paths: Sequence[TreePath], capacity: int):
        if not paths:
            raise ValueError("no sequences to pack: the data gave no samples")
        for i, p in enumerate(paths):
            if len(p.ids) > capacity:
                raise ValueError(
                    f"sample {i} has {len(p.ids)} tokens > the token budget {capacity}: a tree "
                    "row holds each sample's whole history; raise the budget "
                    "(data.tokens_per_batch) or shorten the sample"
                )
        self.paths = list(paths)
        roots = build_trie([p.ids for p in paths])
        self.pieces = [piece for root in roots for piece in split_tree(root, capacity)]
        self.lengths = [piece.size() for piece in self.pieces]

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, item: PackedItem) -> tuple[Piece, bool]:
        return self.pieces[item.index], item.train


class TreeCollator:
    """One tree row from a batch of pieces; a batch repeated only to give every rank the same
    number of steps (``train=False``) runs with no loss."""

    def __init__(self, paths: Sequence[TreePath]):
        self.paths = paths

    def __call__(self, batch: list[tuple[Piece, bool]]) -> PackedRow:
        row = tree_row(self.paths, [piece for piece, _ in batch])
        if all(train for _, train in batch):
            return row
        labels = row.labels.new_full(row.labels.shape, IGNORE_INDEX)
        return PackedRow.build(row.input_ids, labels, row.nopad_meta, indices=row.indices, pairs=([], []))


def tree_dataloader(
    paths: Sequence[TreePath],
    tokens_per_batch: int,
    *,
    num_replicas: int | None = None,
    rank: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    max_seqs_per_batch: int | None = None,
    steps_multiple_of: int = 1,
    attention_cost: float | None = None,
    num_workers: int = 0,
    **loader_kwargs: Any,
) -> PackedDataLoader:
    """The tree rows of ``paths`` for this data-parallel rank, ``tokens_per_batch`` tokens each at
    most; what :func:`nopad.dataloaders.loader.packed_dataloader` is for flat sequences (same sampler,
    same resumable state). ``max_seqs_per_batch`` counts pieces."""
    pieces = TreePieces(paths, tokens_per_batch)
    sampler = PackedBatchSampler(
        pieces.lengths,
        tokens_per_batch,
        num_replicas=num_replicas,
        rank=rank,
        seed=seed,
        shuffle=shuffle,
        max_seqs_per_batch=max_seqs_per_batch,
        overflow="error",
        steps_multiple_of=steps_multiple_of,
        attention_cost=attention_cost,
        unit="prefix-tree pieces",
    )
    return PackedDataLoader(
        pieces, sampler, collate_fn=TreeCollator(pieces.paths), num_workers=num_workers, **loader_kwargs
    )
