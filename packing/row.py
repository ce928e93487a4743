"""The packed row: one flat varlen row of tokens and everything the model and a loss read of it, as
one typed record.

Three producers write this schema - the training collator, the prefix-tree rows
(:mod:`nopad.packing.bins.tree`: GRPO groups, forked episodes, per-turn SFT samples) and flat GRPO
rollouts - and all go through :meth:`PackedRow.build`, the one place that turns token lists into
the row's tensors, counts its loss tokens and checks that its parts agree. A row is also a
read-only ``Mapping`` of its set fields (``row["input_ids"]``, ``"indices" in row``,
``row.keys()``, ``**row``): the ecosystem passes batches as mappings (``model(**batch)``, a data
collator's output, transformers' ``Trainer`` input hooks), and a packed row goes through them as it
is.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch

from nopad.packing.varlen import VarlenMeta

IGNORE_INDEX = -100  # a label that carries no loss (transformers' and torch's cross-entropy default)

# the row's keys when read as a mapping, in order; position_ids is a view of nopad_meta's
KEYS = (
    "input_ids",
    "labels",
    "position_ids",
    "nopad_meta",
    "seq_lens",
    "indices",
    "num_loss_tokens",
    "num_loss_seqs",
    "token_values",
    "pair_tokens",
    "pair_seqs",
    "empty",
)


@dataclass(eq=False)
class PackedRow(Mapping):
    """One packed row. Build it with :meth:`build`; move it with :meth:`to`; call the model with
    ``model(**row.model_kwargs())``.

    Labels follow the transformers convention: ``labels[t]`` is the target of the logits that
    predict token ``t`` (``t - 1`` in a plain row; ``nopad_meta.previous_rows()[t]`` in a
    tree row), :data:`IGNORE_INDEX` where there is no loss.

    A tree row (:mod:`nopad.packing.bins.tree`) lays a token shared by several sequences once, and
    several of them may train on it: its loss is a list of *pairs* (sequence, token), as the flat
    sequences would have it. ``pair_tokens[i]`` is the loss token (index in label order) pair
    ``i`` reads and ``pair_seqs[i]`` its sequence (index into ``indices``); ``token_values`` and
    ``num_loss_tokens`` are per pair. Other rows have no pairs: each loss token is one pair
    (:meth:`per_pair` reads both alike).

    ``token_values`` maps a name to one float32 value per pair (a caller's per-token data, such as
    the generator's log-probs of an RL rollout): the row carries, moves, pins and checks them
    without knowing what they mean.
    """

    input_ids: torch.Tensor  # int64 (1, T)
    labels: torch.Tensor  # int64 (1, T)
    nopad_meta: VarlenMeta  # the row's sequences (T query tokens)
    seq_lens: torch.Tensor  # int64 [sequences of the data] (a collator's filler sequence excluded); host
    num_loss_tokens: int  # labels that carry a loss, for the global normalisation of a step
    num_loss_seqs: int  # sequences with at least one such label
    # int64, host: source row of each sequence (collator), or rollout of each completion (GRPO)
    indices: torch.Tensor | None = None
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> float32 [pairs]
    pair_tokens: torch.Tensor | None = None  # int64 [pairs], tree rows: the loss token each pair reads
    pair_seqs: torch.Tensor | None = None  # int64 [pairs], tree rows: the sequence (in indices) of each pair
    empty: bool = False  # a zero-weight filler row, run only to join the other ranks' collectives

    # ----------------------------------------------------------------- the one builder
    @classmethod
    def build(
        cls,
        input_ids: Sequence[int] | np.ndarray | torch.Tensor,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        meta: VarlenMeta,
        *,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        indices: Sequence[int] | torch.Tensor | None = None,
        token_values: Mapping[str, Sequence[float] | torch.Tensor] | None = None,
        pairs: tuple[Sequence[int], Sequence[int]] | None = None,
        empty: bool = False,
    ) -> PackedRow:
        """A row from its flat tokens and labels (``T`` each) and ``meta`` (``T`` query tokens).

        ``seq_lens`` defaults to the meta's sequence lengths. Each of ``token_values`` holds one
        value per loss token, in label order, or per pair. ``pairs = (pair_tokens,
        pair_seqs)`` (a tree row, see the class docstring): then the row counts one loss token per
        pair and one sequence per distinct ``pair_seqs``. An ``empty`` row counts no loss token and
        no sequence, whatever its labels (its loss is to be weighted zero)."""
        ids, labs = _int64_row(input_ids), _int64_row(labels)
        if meta.seqlens_q is None:
            raise ValueError("a packed row needs host-side sequence lengths; a static decode step has none")
        if ids.shape != labs.shape or ids.shape[1] != meta.total_q:
            raise ValueError(
                f"input_ids ({ids.shape[1]} tokens), labels ({labs.shape[1]}) and nopad_meta "
                f"({meta.total_q} tokens) must describe the same row"
            )
        host = labs[0].cpu().numpy()
        lens = np.asarray(meta.seqlens_q, dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
        own_start = (lens > 0) & (lens == np.asarray(meta.seqlens_k, dtype=np.int64))
        unpredicted = own_start & (host[np.minimum(starts, max(host.size - 1, 0))] != IGNORE_INDEX)
        if unpredicted.any():
            seq = int(np.flatnonzero(unpredicted)[0])
            raise ValueError(
                f"the label of token {int(starts[seq])}, the first of sequence {seq}, carries a "
                f"loss, but nothing before it in its sequence predicts it; set it to "
                f"IGNORE_INDEX ({IGNORE_INDEX})"
            )
        loss = host != IGNORE_INDEX
        running = np.concatenate(([0], np.cumsum(loss)))
        per_seq = running[starts + lens] - running[starts]  # loss tokens of each sequence
        num_loss_tokens, num_loss_seqs = int(running[-1]), int((per_seq > 0).sum())
        pair_tokens = pair_seqs = None
        if pairs is not None:
            pair_tokens, pair_seqs = _pairs(pairs, num_loss_tokens, indices)
            num_loss_tokens, num_loss_seqs = pair_tokens.numel(), int(torch.unique(pair_seqs).numel())
        values = _token_values(token_values or {}, num_loss_tokens)
        return cls(
            input_ids=ids,
            labels=labs,
            nopad_meta=meta,
            seq_lens=_int64_host(meta.seqlens_q if seq_lens is None else seq_lens),
            num_loss_tokens=0 if empty else num_loss_tokens,
            num_loss_seqs=0 if empty else num_loss_seqs,
            indices=None if indices is None else _int64_host(indices),
            pair_tokens=pair_tokens,
            pair_seqs=pair_seqs,
            token_values=values,
            empty=bool(empty),
        )

    @classmethod
    def from_mapping(cls, batch: Mapping[str, Any]) -> PackedRow:
        """A row from a dict with the same keys (a batch built by hand, or a row that code copying
        mappings turned into a dict); the counts are recomputed from its labels."""
        if isinstance(batch, PackedRow):
            return batch
        missing = [k for k in ("input_ids", "labels", "nopad_meta") if k not in batch]
        if missing:
            raise KeyError(
                f"a packed row needs input_ids, labels and nopad_meta; this batch has no "
                f"{missing} (keys: {sorted(batch)})"
            )
        return cls.build(
            batch["input_ids"],
            batch["labels"],
            batch["nopad_meta"],
            seq_lens=batch.get("seq_lens"),
            indices=batch.get("indices"),
            token_values=batch.get("token_values"),
            pairs=(batch["pair_tokens"], batch["pair_seqs"]) if "pair_tokens" in batch else None,
            empty=bool(batch.get("empty", False)),
        )

    # ----------------------------------------------------------------- use
    @property
    def position_ids(self) -> torch.Tensor:
        """int64 ``(1, T)``: the meta's own positions, so attention checks them without a copy or a sync."""
        return self.nopad_meta.position_ids[None]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def loss_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(predict_at, targets)`` of the loss tokens, in label order: the row position whose
        logits predict each (the token before it in its own sequence, ``t - 1`` in a plain row) and
        its id. What every log-prob and loss of a row reads: ``logits_to_keep=predict_at``."""
        labels = self.labels[0]
        targets_at = torch.nonzero(labels != IGNORE_INDEX).squeeze(1)
        predict_at = self.nopad_meta.previous_rows().to(targets_at.device)[targets_at]
        if bool((predict_at < 0).any()):
            raise ValueError("a loss token is the first token of its sequence: nothing predicts it")
        return predict_at, labels[targets_at]

    def per_pair(self, values: torch.Tensor) -> torch.Tensor:
        """Per-loss-token ``values`` (label order, first dimension) as per-pair values: in a tree
        row a token that m sequences train on appears m times (so its gradient counts m times, as
        in the flat sequences); other rows' loss tokens are their pairs."""
        return values if self.pair_tokens is None else values[self.pair_tokens.to(values.device)]

    def with_token_values(self, values: Mapping[str, Sequence[float] | torch.Tensor]) -> PackedRow:
        """The same row with ``values`` added to its ``token_values`` (one value per pair, checked
        as :meth:`build` checks them): for a caller that knows its per-pair data once the rows are
        laid out (the pairs follow ``indices``, each sequence's loss tokens in order)."""
        pairs = self.pair_tokens.numel() if self.pair_tokens is not None else int((self.labels != IGNORE_INDEX).sum())
        return replace(self, token_values={**self.token_values, **_token_values(values, pairs)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedRow:
        """The same row with its model and loss tensors on ``device`` (the meta through
        :meth:`VarlenMeta.to`); ``seq_lens`` and ``indices`` are bookkeeping read on the host, and
        stay there."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            nopad_meta=self.nopad_meta.to(device, non_blocking=non_blocking),
            token_values={k: move(v) for k, v in self.token_values.items()},
            pair_tokens=move(self.pair_tokens),
            pair_seqs=move(self.pair_seqs),
        )

    def pin_memory(self) -> PackedRow:
        """Page-locked copies of the tensors, for ``DataLoader(pin_memory=True)``."""

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(
            self,
            input_ids=pin(self.input_ids),
            labels=pin(self.labels),
            token_values={k: pin(v) for k, v in self.token_values.items()},
            pair_tokens=pin(self.pair_tokens),
            pair_seqs=pin(self.pair_seqs),
        )

    def model_kwargs(self, *, labels: bool = False) -> dict[str, Any]:
        """The keyword arguments of the model's forward: ``model(**row.model_kwargs())``. With
        ``labels`` the model computes its own loss (plain rows only: a tree row's predictions are
        not all at ``t - 1``)."""
        kwargs = {"input_ids": self.input_ids, "position_ids": self.position_ids, "nopad_meta": self.nopad_meta}
        if labels:
            kwargs["labels"] = self.labels
        return kwargs

    # ----------------------------------------------------------------- read as a dict
    def __getitem__(self, key: str) -> Any:
        if not self._is_set(key):
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _FIELDS:
            raise KeyError(
                f"a PackedRow has no field {key!r} (fields: {', '.join(_FIELDS)}); keep extra "
                "data next to the row, or subclass PackedRow"
            )
        setattr(self, key, value)

    def __iter__(self) -> Iterator[str]:
        return (k for k in KEYS if self._is_set(k))

    def _is_set(self, key: str) -> bool:
        """A key of the mapping: a field that is not None, ``empty`` only on an empty row and
        ``token_values`` only when there are some (the keys the rows had as dicts)."""
        if key not in KEYS:
            return False
        if key in ("empty", "token_values"):
            return bool(getattr(self, key))
        return getattr(self, key) is not None

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        rl = f", values={sorted(self.token_values)}" if self.token_values else ""
        rl += ", tree" if self.pair_tokens is not None else ""
        return (
            f"PackedRow(tokens={self.num_tokens}, seqs={self.nopad_meta.num_seqs}, "
            f"loss_tokens={self.num_loss_tokens}{rl}{', empty' if self.empty else ''}, "
            f"device={self.input_ids.device})"
        )


_FIELDS = tuple(f.name for f in fields(PackedRow))


def as_row(batch: Mapping[str, Any]) -> PackedRow:
    """``batch`` itself when it is a :class:`PackedRow`, else the row its keys describe."""
    return batch if isinstance(batch, PackedRow) else PackedRow.from_mapping(batch)


def _int64_row(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.to(torch.int64).reshape(1, -1)
    return torch.from_numpy(np.asarray(values, dtype=np.int64).reshape(1, -1))


def _int64_host(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", torch.int64).reshape(-1)
    return torch.from_numpy(np.asarray(values, dtype=np.int64).reshape(-1))


def _pairs(pairs, num_loss_tokens: int, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """The checked ``(pair_tokens, pair_seqs)`` of a tree row: every loss token read by a pair,
    every pair naming one of the row's sequences."""
    if len(pairs) != 2:
        raise ValueError("pairs must be (pair_tokens, pair_seqs)")
    tokens, seqs = _int64_host(pairs[0]), _int64_host(pairs[1])
    if tokens.shape != seqs.shape:
        raise ValueError(f"pair_tokens ({tokens.numel()}) and pair_seqs ({seqs.numel()}) must name the same pairs")
    read = torch.zeros(num_loss_tokens, dtype=torch.bool)
    if tokens.numel():
        if int(tokens.min()) < 0 or int(tokens.max()) >= num_loss_tokens:
            raise ValueError(
                f"pair_tokens must index the row's {num_loss_tokens} loss tokens, got values in "
                f"[{int(tokens.min())}, {int(tokens.max())}]"
            )
        read[tokens] = True
    if not bool(read.all()):
        raise ValueError(
            f"loss token {int(torch.nonzero(~read)[0])} (label order) has a label but no pair "
            "reads it; set its label to IGNORE_INDEX or give it a pair"
        )
    count = None if indices is None else len(indices)
    if seqs.numel() and (int(seqs.min()) < 0 or (count is not None and int(seqs.max()) >= count)):
        raise ValueError(
            f"pair_seqs must index the row's {count} sequences (indices), got values in "
            f"[{int(seqs.min())}, {int(seqs.max())}]"
        )
    return tokens, seqs


def _token_values(values: Mapping[str, Any], num_pairs: int) -> dict[str, torch.Tensor]:
    """``values`` as float32 tensors, each checked to hold one value per loss pair."""
    if not isinstance(values, Mapping):
        raise TypeError(f"token_values must map a name to one value per loss token, got {type(values).__name__}")
    out = {}
    for name, v in values.items():
        if not isinstance(name, str):
            raise TypeError(f"token_values names must be strings, got {name!r}")
        try:
            t = v.to(torch.float32) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"token_values[{name!r}] must be numbers, one per loss token, got {type(v).__name__} ({e})"
            ) from None
        if t.shape != (num_pairs,):
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but the row has {num_pairs} loss tokens: "
                "one value per loss token, in label order (per pair in a tree row)"
            )
        out[name] = t
    return out
