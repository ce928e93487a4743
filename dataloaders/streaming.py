"""Packed batches from a stream (an HF ``IterableDataset``, a generator function, any iterable)
with the core's bounded-buffer :class:`~nopad.packing.bins.streaming.StreamingPacker`.

Every rank reads the whole stream and runs the same deterministic packer, so all ranks agree on
every bin without communicating; closed bins are collected in windows of ``balance_window x
num_ranks`` and handed out by cost (:mod:`nopad.dataloaders.balance`), so every step is balanced and
every rank gets the same number of steps (the last window is split/duplicated as in map-style).
Each rank keeps the rows only until their bin is handed out and collates only its own bins.

Packing runs in the calling process; the loader is its own iterable of collated batches - use it
directly, not inside a DataLoader with workers (each worker would replay the whole stream). To
read and tokenize in worker processes, make the *source* a DataLoader over the stream
(``DataLoader(hf_iterable.map(tokenize), batch_size=None, num_workers=k)``): its order is
deterministic, so resuming by skipping rows still gives exactly the same batches.
``steps_multiple_of`` (e.g. gradient-accumulation steps) makes every window, and the epoch, a
whole number of optimizer steps.

Resume: ``state_dict()`` holds the packer's buffer, the rows it refers to, the closed bins not yet
handed out and the number of rows read, so a resumed run yields exactly the same batches. The
stream is re-opened and that many rows are skipped, so ``source`` must be re-iterable (or a
function returning a fresh iterator).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from nopad.dataloaders.balance import balance_bins, bin_cost, default_attention_cost
from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.dataset import MASK_COLUMNS, document_lengths, slice_lengths
from nopad.dataloaders.sampler import check_fingerprint
from nopad.dataloaders.telemetry import log_epoch_stats
from nopad.packing import distributed
from nopad.packing.row import IGNORE_INDEX

logger = logging.getLogger(__name__)


class StreamingPackedLoader(IterableDataset):
    """Iterate packed varlen batches (collator output) for this rank from a stream of tokenized
    rows (dicts with ``input_ids`` and optionally ``labels`` or a loss-mask column). A batch's
    ``indices`` are positions in the stream (0 = first row of the epoch)."""

    def __init__(
        self,
        source: Iterable[dict] | Callable[[], Iterator[dict]],
        tokens_per_batch: int,
        *,
        buffer_size: int = 1000,
        num_replicas: int | None = None,
        rank: int | None = None,
        seed: int | None = 0,
        max_seqs_per_batch: int | None = None,
        overflow: str = "error",
        balance_window: int = 8,
        steps_multiple_of: int = 1,
        attention_cost: float | None = None,
        collator: PackedCollator | None = None,
    ):
        if not callable(source) and iter(source) is source:
            raise TypeError(
                "source is a one-shot iterator, which cannot be re-opened to resume; pass a "
                "re-iterable (an HF IterableDataset, a list) or a function returning a fresh iterator"
            )
        self.num_replicas = distributed.world_size() if num_replicas is None else int(num_replicas)
        self.rank = distributed.rank() if rank is None else int(rank)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside [0, num_replicas={self.num_replicas})")
        if balance_window < 1 or steps_multiple_of < 1:
            raise ValueError(
                f"balance_window and steps_multiple_of must be >= 1, got {balance_window}, {steps_multiple_of}"
            )
        self.source = source
        self.tokens_per_batch = int(tokens_per_batch)
        self.buffer_size = int(buffer_size)
        self.seed = seed
        self.max_seqs_per_batch = max_seqs_per_batch
        self.overflow = overflow
        self.steps_multiple_of = int(steps_multiple_of)
        self.window = balance_window * self.num_replicas * self.steps_multiple_of
        self.attention_cost = default_attention_cost() if attention_cost is None else attention_cost
        self.collator = collator or PackedCollator()
        self.balance_window = int(balance_window)
        self.epoch = 0
        self._resume_digest: str | None = None  # lengths digest of the skipped rows, checked on re-read
        self._new_packer()  # validates capacity / buffer / overflow now, not at the first batch
        self._reset_epoch()
        self.last_stats: dict | None = None

    # ------------------------------------------------------------------ state
    def _new_packer(self):
        from nopad.packing import StreamingPacker

        seed = None if self.seed is None else self.seed + self.epoch
        self.packer = StreamingPacker(
            self.tokens_per_batch,
            self.buffer_size,
            max_seqs_per_bin=self.max_seqs_per_batch,
            seed=seed,
            overflow=self.overflow,
        )

    def _reset_epoch(self) -> None:
        self._new_packer()
        self.rows_read = 0
        self.digest = hashlib.sha256()  # of the lengths of the rows read this epoch
        self.rows: dict[int, dict] = {}  # key (row number) -> row, while some piece is not out
        self.pieces_left: dict[int, int] = {}
        self.closed: list[list[tuple]] = []  # closed bins waiting for a full window
        self.steps: list[list[list[tuple]]] = []  # planned steps: per rank one bin of items
        self.totals = {
            "steps": 0,
            "tokens": 0,
            "bins": 0,
            "duplicated": 0,
            "splits": 0,
            "dropped": 0,
            "step_max": 0.0,
            "step_mean": 0.0,
            "rank_cost": [0.0] * self.num_replicas,
        }

    def fingerprint(self) -> dict:
        """The settings that shape the bins and steps; a checkpoint made under others cannot resume."""
        return {
            "tokens_per_batch": self.tokens_per_batch,
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "max_seqs_per_batch": self.max_seqs_per_batch,
            "overflow": self.overflow,
            "balance_window": self.balance_window,
            "steps_multiple_of": self.steps_multiple_of,
            "num_replicas": self.num_replicas,
            "attention_cost": float(self.attention_cost),
        }

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "rows_read": self.rows_read,
            "packer": self.packer.state_dict(),
            "rows": dict(self.rows),
            "pieces_left": dict(self.pieces_left),
            "closed": [list(b) for b in self.closed],
            "steps": [list(s) for s in self.steps],
            "totals": {**self.totals, "rank_cost": list(self.totals["rank_cost"])},
            "fingerprint": self.fingerprint(),
            "lengths_digest": self.digest.hexdigest()[:16],
        }

    def load_state_dict(self, state: dict) -> None:
        expected = (
            "epoch",
            "rows_read",
            "packer",
            "rows",
            "pieces_left",
            "closed",
            "steps",
            "totals",
            "fingerprint",
            "lengths_digest",
        )
        if not isinstance(state, dict) or any(k not in state for k in expected):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a StreamingPackedLoader state (expected keys "
                f"{list(expected)}, got {keys}); pass what state_dict() returned"
            )
        check_fingerprint(state["fingerprint"], self.fingerprint())
        self.epoch = state["epoch"]
        self._reset_epoch()
        self.packer.load_state_dict(state["packer"])
        self.rows_read = state["rows_read"]
        self._resume_digest = state["lengths_digest"]
        self.rows, self.pieces_left = dict(state["rows"]), dict(state["pieces_left"])
        self.closed = [[tuple(i) for i in b] for b in state["closed"]]
        self.steps = [[[tuple(i) for i in b] for b in s] for s in state["steps"]]
        self.totals = {**state["totals"], "rank_cost": list(state["totals"]["rank_cost"])}

    # ------------------------------------------------------------------ iteration
    def _open(self) -> Iterator[dict]:
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(self.epoch)
        fresh = callable(self.source) and not hasattr(self.source, "__iter__")
        stream = self.source() if fresh else iter(self.source)
        expected = self._resume_digest or self.digest.hexdigest()[:16]
        if self.rows_read == 0:
            return stream
        # resuming: re-read the rows already packed and check they are the ones the checkpoint saw
        self.digest, skipped = hashlib.sha256(), 0
        for row in itertools.islice(stream, self.rows_read):
            self.digest.update(np.int64(len(row["input_ids"])).tobytes())
            skipped += 1
        if skipped != self.rows_read or self.digest.hexdigest()[:16] != expected:
            raise ValueError(
                f"cannot resume: the stream's first {self.rows_read} rows are not the ones the checkpoint "
                f"read (lengths_digest {self.digest.hexdigest()[:16]} over {skipped} rows != "
                f"{expected}); resume with the same data in the same order"
            )
        self._resume_digest = None
        return stream

    def _add(self, row: dict) -> None:
        if "input_ids" not in row:
            raise KeyError(
                f"stream row {self.rows_read} has no 'input_ids' (keys: {sorted(row)}); "
                "tokenize the stream first, e.g. ds.map(tokenize)"
            )
        key, length = self.rows_read, len(row["input_ids"])
        self.rows_read += 1
        self.digest.update(np.int64(length).tobytes())
        if length == 0:
            self.totals["dropped"] += 1
            return
        pieces = -(-length // self.tokens_per_batch) if self.overflow == "split" else 1
        docs = document_lengths(row, length, f"stream row {key}")  # packed rows without boundaries fail
        keep = ["input_ids", "labels"] + [c for c in MASK_COLUMNS if c in row]
        self.rows[key] = {c: row[c] for c in keep if c in row}
        if docs is not None:
            self.rows[key]["seq_lengths"] = docs.tolist()
        self.pieces_left[key] = pieces
        self.closed += [[tuple(i) for i in b] for b in self.packer.add(length, key)]

    def _plan(self, bins: list[list[tuple]]) -> None:
        """Turn closed bins into balanced steps; a short last window is split/duplicated to a
        multiple of the rank count."""
        lengths = np.array([item[1] for b in bins for item in b], dtype=np.int64)
        offsets = np.cumsum([0] + [len(b) for b in bins])
        item_bins = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(bins))]
        flat = [item for b in bins for item in b]
        seed = None if self.seed is None else self.seed + 7919 * self.epoch + self.totals["bins"]
        plan = balance_bins(
            item_bins,
            lengths,
            self.num_replicas,
            steps_multiple_of=self.steps_multiple_of,
            attention_cost=self.attention_cost,
            seed=seed,
        )
        for step in plan.steps:
            costs, per_rank = [], []
            for r, b in enumerate(step):
                train = b not in plan.duplicated
                per_rank.append([flat[i] if train else (*flat[i][:3], False) for i in plan.bins[b]])
                if not train:  # the repeated rows must stay until the repeat is handed out too
                    for i in plan.bins[b]:
                        self.pieces_left[flat[i][0]] += 1
                cost = bin_cost(lengths[plan.bins[b]], 1.0, self.attention_cost)
                costs.append(cost)
                self.totals["rank_cost"][r] += cost
            self.steps.append(per_rank)
            self.totals["step_max"] += max(costs)
            self.totals["step_mean"] += sum(costs) / len(costs)
        self.totals["bins"] += len(plan.bins)
        self.totals["splits"] += plan.bins_split
        self.totals["duplicated"] += sum(len(plan.bins[b]) for b in plan.duplicated)
        self.totals["steps"] += plan.num_steps

    def _emit(self) -> dict:
        step = self.steps.pop(0)
        mine = step[self.rank]
        examples = []
        for item in mine:
            key, length, start = item[:3]
            row = self.rows[key]
            ids = np.asarray(row["input_ids"], dtype=np.int64)
            labels = np.asarray(row.get("labels", ids), dtype=np.int64)
            mask_col = next((c for c in MASK_COLUMNS if c in row), None)
            if mask_col is not None:
                labels = np.where(np.asarray(row[mask_col], dtype=bool), labels, IGNORE_INDEX)
            train = len(item) < 4 or item[3]
            piece = slice(start, start + length)
            example = {"input_ids": ids[piece], "labels": labels[piece], "index": key, "train": train}
            if "seq_lengths" in row:
                example["seq_lengths"] = slice_lengths(np.asarray(row["seq_lengths"]), start, length)
            examples.append(example)
        for items in step:  # free rows whose every piece has been handed out (on any rank)
            for item in items:
                if len(item) < 4 or item[3]:  # not a loss-masked repeat
                    self.totals["tokens"] += item[1]
                self.pieces_left[item[0]] -= 1
                if self.pieces_left[item[0]] == 0:
                    del self.pieces_left[item[0]], self.rows[item[0]]
        return self.collator(examples)

    def __iter__(self) -> Iterator[dict]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "StreamingPackedLoader packs in the calling process; iterate it directly "
                "or with DataLoader(..., batch_size=None, num_workers=0)"
            )
        stream = self._open()
        exhausted = False
        while True:
            while self.steps:
                yield self._emit()
            if exhausted:
                break
            for row in stream:
                self._add(row)
                if len(self.closed) >= self.window:
                    bins, self.closed = self.closed[: self.window], self.closed[self.window :]
                    self._plan(bins)
                    break
            else:
                exhausted = True
                tail = self.closed + [[tuple(i) for i in b] for b in self.packer.flush()]
                self.closed = []
                if tail:
                    self._plan(tail)
                elif self.totals["bins"] == 0:
                    raise ValueError("the stream is empty: there is nothing to pack")
        self._finish_epoch()

    def _finish_epoch(self) -> None:
        t = self.totals
        rank_cost = np.array(t["rank_cost"])
        self.last_stats = {
            "epoch": self.epoch,
            "num_sequences": self.rows_read,
            "num_bins": t["bins"],
            "steps_per_rank": t["steps"],
            "num_ranks": self.num_replicas,
            "tokens": t["tokens"],
            "efficiency": t["tokens"] / (t["bins"] * self.tokens_per_batch),
            "tokens_truncated": self.packer.tokens_truncated,
            "sequences_split": self.packer.num_split,
            "sequences_dropped": t["dropped"],
            "sequences_duplicated": t["duplicated"],
            "bins_split_for_balance": t["splits"],
            "rank_cost_skew": float(rank_cost.max() / rank_cost.mean()),
            "step_cost_skew": t["step_max"] / t["step_mean"],
        }
        log_epoch_stats(self.last_stats, rank=self.rank)
        self.epoch += 1
        self._reset_epoch()
