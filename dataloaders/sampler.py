"""Token-budget batch sampler: each step is one bin of whole sequences that fits the budget.

Every epoch the sampler packs ALL lengths with the core's best-fit-decreasing (``nopad.packing.pack``,
seeded by ``seed + epoch``), then balances the bins over the data-parallel ranks
(:mod:`nopad.dataloaders.balance`). Every rank computes the same plan from the same lengths and seed and
keeps its own column, so no communication is needed and every rank runs the same number of steps.

It does its own sharding: do NOT also shard it with a ``DistributedSampler`` or by passing the
DataLoader through ``accelerator.prepare`` (see :mod:`nopad.dataloaders.loader`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from nopad.dataloaders.balance import RankPlan, balance_bins
from nopad.dataloaders.dataset import PackedItem
from nopad.dataloaders.telemetry import epoch_stats, log_epoch_stats
from nopad.packing import distributed

logger = logging.getLogger(__name__)


class PackedBatchSampler(Sampler[list[PackedItem]]):
    """Yield, for this rank, lists of :class:`PackedItem` whose lengths sum to at most
    ``tokens_per_batch``.

    ``overflow`` is the core's: ``"error"`` (a sequence longer than the budget is a clear error),
    ``"truncate"`` or ``"split"``. ``steps_multiple_of`` makes the number of steps per rank a
    multiple of, e.g., the gradient-accumulation steps, so no optimizer step is left partial.
    ``shuffle=False`` keeps the costliest steps first (handy to surface out-of-memory early).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        tokens_per_batch: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        max_seqs_per_batch: int | None = None,
        overflow: str = "error",
        steps_multiple_of: int = 1,
        token_cost: float = 1.0,
        attention_cost: float | None = None,
        unit: str = "sequences",
    ):
        self.unit = unit  # what one length is, for the epoch log ("pre-packed rows" for packed data)
        self.num_replicas = distributed.world_size() if num_replicas is None else int(num_replicas)
        self.rank = distributed.rank() if rank is None else int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, num_replicas={self.num_replicas})")
        if tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.size == 0:
            raise ValueError("no sequences to sample: the dataset is empty")
        self.tokens_per_batch = int(tokens_per_batch)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.max_seqs_per_batch = max_seqs_per_batch
        self.overflow = overflow
        self.steps_multiple_of = int(steps_multiple_of)
        self.token_cost = token_cost
        self.attention_cost = attention_cost
        self.epoch = 0
        self.start_step = 0  # set by the loader when resuming mid-epoch
        self._plan_epoch: int | None = None
        self._batches: list[list[PackedItem]] = []
        self.last_stats: dict | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _plan(self) -> list[list[PackedItem]]:
        """This rank's batches for ``self.epoch`` (computed once per epoch)."""
        if self._plan_epoch == self.epoch:
            return self._batches
        from nopad.packing import pack

        packed = pack(
            self.lengths,
            self.tokens_per_batch,
            strategy="bfd",
            max_seqs_per_bin=self.max_seqs_per_batch,
            seed=self.seed + self.epoch if self.shuffle else None,
            overflow=self.overflow,
            skip_empty=True,
        )
        offsets = np.asarray(packed.offsets)
        indices, starts, piece_lengths = packed.indices, packed.starts, packed.lengths
        bins = np.split(np.arange(indices.size, dtype=np.int64), offsets[1:-1])
        plan: RankPlan = balance_bins(
            bins,
            piece_lengths,
            self.num_replicas,
            steps_multiple_of=self.steps_multiple_of,
            token_cost=self.token_cost,
            attention_cost=self.attention_cost,
            seed=self.seed + self.epoch if self.shuffle else None,
        )
        self._batches = [
            [PackedItem(int(indices[i]), int(starts[i]), int(piece_lengths[i]), train) for i in plan.bins[bin_id]]
            for bin_id in plan.rank_bins(self.rank)
            for train in [bin_id not in plan.duplicated]
        ]
        self._plan_epoch = self.epoch
        self.last_stats = epoch_stats(
            epoch=self.epoch,
            num_sequences=int(self.lengths.size),
            capacity=self.tokens_per_batch,
            pack_stats=packed.stats,
            plan=plan,
            item_lengths=piece_lengths,
            item_indices=indices,
            unit=self.unit,
        )
        log_epoch_stats(self.last_stats, rank=self.rank)
        return self._batches

    def __iter__(self) -> Iterator[list[PackedItem]]:
        batches = self._plan()
        start, self.start_step = self.start_step, 0
        yield from batches[start:]

    def __len__(self) -> int:
        return len(self._plan())

    def fingerprint(self) -> dict:
        """Everything that shapes this rank's epoch plan: a checkpoint made under another plan
        cannot be resumed (its position would skip or repeat other rows)."""
        return {
            "num_sequences": int(self.lengths.size),
            "lengths_digest": lengths_digest(self.lengths),
            "tokens_per_batch": self.tokens_per_batch,
            "max_seqs_per_batch": self.max_seqs_per_batch,
            "overflow": self.overflow,
            "shuffle": bool(self.shuffle),
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "steps_multiple_of": self.steps_multiple_of,
            "token_cost": float(self.token_cost),
            "attention_cost": None if self.attention_cost is None else float(self.attention_cost),
        }

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "fingerprint" not in state or "epoch" not in state:
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a PackedBatchSampler state (expected 'epoch' and "
                f"'fingerprint', got {keys}); pass what state_dict() returned"
            )
        check_fingerprint(state["fingerprint"], self.fingerprint())
        self.set_epoch(state["epoch"])


def lengths_digest(lengths: np.ndarray) -> str:
    """A short hash of the sequence lengths: different data with the same row count differs."""
    return hashlib.sha256(np.ascontiguousarray(lengths, dtype=np.int64).tobytes()).hexdigest()[:16]


def check_fingerprint(saved: dict, mine: dict) -> None:
    """Raise naming the first setting that differs between a checkpoint and this loader."""
    if not isinstance(saved, dict):
        raise ValueError(
            f"the checkpoint's loader fingerprint is a {type(saved).__name__}, not a dict; "
            "it was not written by this loader"
        )
    for key, value in mine.items():
        if key not in saved:
            raise ValueError(
                f"cannot resume: the checkpoint's loader state has no {key!r} (it was "
                "written by another loader or version); start a new run instead"
            )
        if saved[key] != value:
            raise ValueError(
                f"cannot resume: the checkpoint was made with {key}={saved[key]!r} but this loader has "
                f"{key}={value!r}; the epoch plan would differ and rows would be skipped or repeated. "
                "Resume with the same data and settings"
            )
