"""Where each recurrent state of a row starts: the one plan that the varlen recurrent mixers
(:mod:`nopad.packing.mixers.delta_rule`, and any scan that carries a state from token to token) follow
on packed rows and prefix-tree rows.

A packed row's sequences each start from a zero state (or the caller's initial state). In a
prefix-tree row (:mod:`nopad.packing.bins.tree`) a segment continues its parent node's path: its state
must start from the state *after the parent's last token*, which may lie in the middle of another
segment (a chain laid as one segment, with a sibling branching off half-way). So the plan cuts
each segment after every row some other segment branches from: a *piece* is a run of rows that
starts from one known state (zero, the caller's, or the final state of an earlier piece) and
whose own final state is what its children start from. Pieces whose parents are done form a
*wave*; a wave runs as one batched (or one varlen) call, so a row costs one call per tree level,
not one per piece. The parent of a segment is read from the row itself: the last of its context
keys (``VarlenMeta.key_rows``) is its parent's last token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from nopad.packing.varlen import VarlenMeta


@dataclass(frozen=True)
class Piece:
    """Rows ``start:end`` of the row, run from the final state of piece ``parent`` (-1: the
    sequence's initial state, zero unless the caller gives one)."""

    start: int
    end: int
    seq: int  # the row's sequence (segment) the rows belong to
    parent: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RecurrencePlan:
    """The pieces of one row, the waves they run in, and each sequence's last piece."""

    pieces: tuple[Piece, ...]
    waves: tuple[tuple[int, ...], ...]  # piece indices; a piece's parent is in an earlier wave
    last_piece: tuple[int, ...]  # per sequence: the piece whose final state is its own (-1: empty)
    is_parent: tuple[bool, ...]  # per piece: some piece starts from its final state

    @property
    def is_flat(self) -> bool:
        """One piece per non-empty sequence, each from its initial state: a plain packed row."""
        return len(self.waves) <= 1 and all(p.parent == -1 for p in self.pieces)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def recurrence_plan(meta: VarlenMeta) -> RecurrencePlan:
    """The plan of ``meta``'s row (cached per meta, so once per forward, not once per layer)."""
    plan = _PLANS.get(meta)
    if plan is None:
        plan = _PLANS[meta] = _build_plan(meta)
    return plan


def parent_rows(meta: VarlenMeta) -> np.ndarray:
    """Per sequence of the row, the row of the token its state continues from (-1: none). A
    segment with context keys continues its path from the last of them (a tree row); a sequence
    whose context is only in a cache (a paged generation step) cannot be run here."""
    if meta.seqlens_q is None:
        raise ValueError("a recurrent mixer needs the row's host-side lengths; a static decode step has none")
    lens_q = np.asarray(meta.seqlens_q, dtype=np.int64)
    ctx = np.asarray(meta.seqlens_k, dtype=np.int64) - lens_q
    parents = np.full(lens_q.size, -1, dtype=np.int64)
    if not ctx.any():
        return parents
    if meta.key_rows is None:
        raise ValueError(
            "this row continues sequences whose earlier tokens are in a cache (a generation "
            "step); "
            "nopad's recurrent mixers run packed and prefix-tree rows only (use_cache=False)"
        )
    key_rows = meta.key_rows.detach().cpu().numpy()
    cu_k = np.concatenate(([0], np.cumsum(meta.seqlens_k)))
    has = ctx > 0
    parents[has] = key_rows[cu_k[:-1][has] + ctx[has] - 1]
    return parents


def _build_plan(meta: VarlenMeta) -> RecurrencePlan:
    lens = np.asarray(meta.seqlens_q if meta.seqlens_q is not None else (), dtype=np.int64)
    parents = parent_rows(meta)
    cu = np.concatenate(([0], np.cumsum(lens)))
    forks = np.unique(parents[parents >= 0])
    pieces: list[Piece] = []
    wave_of: list[int] = []
    ending_at: dict[int, int] = {}  # last row of a piece -> the piece
    last_piece = [-1] * lens.size
    for i in range(lens.size):
        start, end = int(cu[i]), int(cu[i + 1])
        if start == end:
            continue
        inner = forks[(forks >= start) & (forks < end - 1)]  # cut after each row a branch leaves from
        bounds = [start, *(int(r) + 1 for r in inner), end]
        parent = -1
        if parents[i] >= 0:
            if parents[i] >= start or int(parents[i]) not in ending_at:
                raise ValueError(
                    f"sequence {i} of this row continues row {int(parents[i])}, which is not "
                    "laid "
                    "before it; tree rows lay every node after its parent"
                )
            parent = ending_at[int(parents[i])]
        for a, b in zip(bounds[:-1], bounds[1:]):
            pieces.append(Piece(a, b, i, parent))
            wave_of.append(0 if parent < 0 else wave_of[parent] + 1)
            parent = len(pieces) - 1
            ending_at[b - 1] = parent
        last_piece[i] = parent
    waves: list[list[int]] = [[] for _ in range(max(wave_of, default=-1) + 1)]
    for p, w in enumerate(wave_of):
        waves[w].append(p)
    is_parent = [False] * len(pieces)
    for piece in pieces:
        if piece.parent >= 0:
            is_parent[piece.parent] = True
    return RecurrencePlan(tuple(pieces), tuple(tuple(w) for w in waves), tuple(last_piece), tuple(is_parent))
