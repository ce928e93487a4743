"""A step a decode batch (:mod:`nopad.inference.decode_batch`) launched, until its draws are appended:
what completing it reads, kept apart from the batch's arrays, since an overlapped step completes after
the batch may have lost rows; and the row masks both keep."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from nopad.inference.request import Sequence
from nopad.inference.sampler import PendingSample


@dataclass
class Launched:
    """A step the batch launched, until its draws are appended: what completing it reads, kept apart
    from the batch's arrays (an overlapped step completes after the batch may have lost rows)."""

    seqs: list[Sequence]
    lists: list[list[list]]  # per field, each row's own list (see DecodeBatch._per_row)
    arrival: np.ndarray
    limit: np.ndarray
    stop_ids: np.ndarray | None
    strings: np.ndarray | None  # rows with stop strings (None: no row has any)
    tops: np.ndarray | None  # rows asking for top log-probs (None: no row asks)
    lengths: np.ndarray  # each row's token count once this step's draw is appended
    sample: PendingSample
    clean: bool = True  # no row left the batch since the launch: every row appends

    def only(self, keep: np.ndarray) -> Launched:
        """The rows ``keep`` (a boolean mask) of this step."""
        return dataclasses.replace(
            self,
            seqs=[q for q, k in zip(self.seqs, keep.tolist()) if k],
            lists=rows_of(self.lists, keep),
            arrival=self.arrival[keep],
            limit=self.limit[keep],
            stop_ids=masked(self.stop_ids, keep),
            strings=masked(self.strings, keep),
            tops=masked(self.tops, keep),
            lengths=self.lengths[keep],
        )


def rows_of(lists: list[list], keep: np.ndarray) -> list[list]:
    """The rows ``keep`` (a boolean mask) of each per-row list."""
    kept = keep.tolist()
    return [[x for x, k in zip(column, kept) if k] for column in lists]


def row_mask(flags: list[bool]) -> np.ndarray | None:
    """A boolean row mask, or None when no row is set (the common case: nothing to check per step)."""
    return np.array(flags, dtype=bool) if any(flags) else None


def masked(rows: np.ndarray | None, keep: np.ndarray) -> np.ndarray | None:
    """The rows ``keep`` of a per-row array that may be absent."""
    return None if rows is None else rows[keep]
