"""A causal-LM loss normalised by the GLOBAL number of loss tokens (or sequences) of one optimizer
step: all micro-batches of the gradient-accumulation window, on all data-parallel ranks.

Why: packed batches hold different numbers of loss tokens, so averaging per micro-batch (or per
rank) weights a token in a sparse batch more than one in a dense batch, and the gradient is no
longer the one of the unpacked run. Dividing every micro-batch's summed loss by the same global
count - and undoing the averaging that DDP/DeepSpeed apply to gradients - gives exactly the
gradient of ``mean over all loss tokens of the step``.

Usage, once per optimizer step::

    loss_fn = PackedLoss(weighting="token")        # world size taken from torch.distributed
    loss_fn.start_step(window)                     # the step's micro-batches (PackedRows)
    for batch in window:
        loss_fn.model_loss(model, batch).backward()  # DDP: no_sync() on all but the last
        # or, from logits you already have: loss_fn(model(**batch.model_kwargs()).logits, batch)

Under Accelerate, DeepSpeed or FSDP2 the step's owner is
:class:`training.accumulation.OptimizerStepper` (SFT and GRPO use it), which normalises the same
way from :func:`causal_lm_loss_sum` and undoes each engine's own divisions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from packing import distributed
from packing.lm_head import nll_sum
from packing.row import IGNORE_INDEX, PackedRow, as_row

WEIGHTINGS = ("token", "sequence")


def causal_lm_loss_sum(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    seq_idx: torch.Tensor | None = None,
    weighting: str = "token",
) -> torch.Tensor:
    """Summed next-token cross-entropy of one packed row (fp32).

    ``labels`` use the transformers convention (shifted here). ``"token"`` sums over loss tokens;
    ``"sequence"`` weights each sequence's tokens by 1 / (its loss tokens), so the sum is the sum
    over sequences of their mean loss (needs ``seq_idx``, e.g. ``row.nopad_meta.seq_idx``).
    """
    _check_weighting(weighting)
    logits = logits.reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1).to(logits.device)
    if logits.shape[0] != labels.shape[0]:
        raise ValueError(f"logits have {logits.shape[0]} positions but labels {labels.shape[0]}")
    targets = labels[1:]
    losses = F.cross_entropy(logits[:-1].float(), targets, ignore_index=IGNORE_INDEX, reduction="none")
    if weighting == "token":
        return losses.sum()
    if seq_idx is None:
        raise ValueError("weighting='sequence' needs seq_idx (row.nopad_meta.seq_idx)")
    owner = seq_idx.reshape(-1).to(labels.device).long()[1:]  # the sequence each target belongs to
    valid = (targets != IGNORE_INDEX).float()
    per_seq = torch.zeros(int(seq_idx.max()) + 1 if seq_idx.numel() else 1, device=labels.device)
    per_seq.index_add_(0, owner, valid)
    weights = valid / per_seq[owner].clamp(min=1)
    return (losses * weights).sum()


def row_loss_sum(logits: torch.Tensor, row: PackedRow, *, weighting: str = "token") -> torch.Tensor:
    """Summed next-token cross-entropy of one packed row (fp32), from the logits of every position.

    A plain row is :func:`causal_lm_loss_sum`. A tree row (:mod:`packing.bins.tree`) reads each
    loss token's logits where its own sequence predicts it (:meth:`PackedRow.loss_tokens`) and
    counts it once per sequence that trains on it (its pairs), as the flat sequences would; with
    ``"sequence"`` each pair is weighted by 1 / (its sequence's pairs). :func:`row_nll_sum` is the
    same loss from the model, without the row's logits."""
    if row.pair_tokens is None:
        return causal_lm_loss_sum(logits, row.labels, seq_idx=row.nopad_meta.seq_idx, weighting=weighting)
    _check_weighting(weighting)
    logits = logits.reshape(-1, logits.shape[-1])
    predict_at, targets = row.loss_tokens()
    predict_at, targets = predict_at.to(logits.device), targets.to(logits.device)
    losses = row.per_pair(F.cross_entropy(logits[predict_at].float(), targets, reduction="none"))
    return _weighted_sum(losses, row, predict_at, weighting)


def row_nll_sum(model: torch.nn.Module, row: PackedRow, *, weighting: str = "token") -> torch.Tensor:
    """:func:`row_loss_sum` of ``row`` under ``model``, computed from the model's hidden states at
    the loss positions only, through the chunked LM head (:func:`packing.lm_head.nll_sum`): the
    row's ``T x V`` logits never exist, and a tree row's shared token goes through the head once
    (weighted by the pairs that train on it)."""
    _check_weighting(weighting)
    predict_at, targets = row.loss_tokens()
    pairs = torch.ones(row.per_pair(targets).shape, dtype=torch.float32, device=targets.device)
    pair_weights = _weighted_sum(pairs, row, predict_at, weighting, reduce=False)
    if row.pair_tokens is None:
        weights = pair_weights
    else:  # a token's weight is the sum of its pairs'
        weights = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        weights.index_add_(0, row.pair_tokens.to(targets.device), pair_weights)
    return nll_sum(model, row.model_kwargs(), predict_at, targets, weights)


def _weighted_sum(losses: torch.Tensor, row: PackedRow, predict_at: torch.Tensor,
                  weighting: str, *, reduce: bool = True) -> torch.Tensor:
    """The row's per-pair ``losses`` summed (``"token"``) or each weighted by 1 / (its sequence's
    pairs) (``"sequence"``); ``reduce`` False: the weighted losses, not summed."""
    if weighting == "token":
        return losses.sum() if reduce else losses
    if row.pair_tokens is not None:
        seqs = row.pair_seqs.to(losses.device)
    else:  # a plain row: the sequence of the position that predicts each loss token
        seqs = row.nopad_meta.seq_idx.reshape(-1).to(losses.device).long()[predict_at.to(losses.device)]
    per_seq = torch.zeros(int(seqs.max()) + 1 if seqs.numel() else 1, device=losses.device)
    per_seq.index_add_(0, seqs, torch.ones_like(losses))
    weighted = losses / per_seq[seqs]
    return weighted.sum() if reduce else weighted


def _check_weighting(weighting: str) -> None:
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {WEIGHTINGS}")


class PackedLoss:
    """Loss for ``backward`` such that the accumulated, rank-averaged gradient equals the gradient
    of the mean loss over every loss token (or sequence) of the optimizer step.

    ``world_size``: the number of ranks DDP/DeepSpeed average gradients over (default: from
    torch.distributed); the loss is multiplied by it to undo that averaging. For a hand-written
    loop with a plain ``loss.backward()``; under Accelerate or DeepSpeed, whose backward also
    divides by the accumulation steps, use :class:`training.accumulation.OptimizerStepper`, which
    undoes every engine's divisions in one place.
    """

    def __init__(
        self,
        weighting: str = "token",
        *,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
    ):
        _check_weighting(weighting)
        if world_size is None:
            world_size = distributed.world_size(group)
        self.weighting = weighting
        self.scale = float(world_size)
        self.group = group
        self.denominator: float | None = None

    def count(self, row: PackedRow) -> int:
        """What ``row`` adds to the step's denominator: its loss tokens, or its sequences with one."""
        return row.num_loss_tokens if self.weighting == "token" else row.num_loss_seqs

    def start_step(self, micro_batches: Sequence[PackedRow | Mapping]) -> float:
        """All-reduce the step's loss-token (or sequence) count; every rank must call this once
        per optimizer step, with its own micro-batches of that step (rows, or dicts with a row's keys)."""
        local = sum(self.count(as_row(b)) for b in micro_batches)
        self.denominator = distributed.global_sum(local, self.group)
        return self.denominator

    def __call__(self, logits: torch.Tensor, batch: PackedRow | Mapping) -> torch.Tensor:
        """The loss of ``batch`` from the ``logits`` of every position (:func:`row_loss_sum`)."""
        self._require_step()
        return self._scaled(row_loss_sum(logits, as_row(batch), weighting=self.weighting))

    def model_loss(self, model: torch.nn.Module, batch: PackedRow | Mapping) -> torch.Tensor:
        """The same loss, running ``model`` on ``batch`` with the chunked LM head
        (:func:`row_nll_sum`): no ``T x V`` logits."""
        self._require_step()
        return self._scaled(row_nll_sum(model, as_row(batch), weighting=self.weighting))

    def _require_step(self) -> None:
        if self.denominator is None:
            raise RuntimeError("call start_step(micro_batches) before computing the loss of a step")

    def _scaled(self, total: torch.Tensor) -> torch.Tensor:
        # a step with no loss tokens anywhere still runs backward (collectives must match): 0 grad
        return total * (self.scale / max(self.denominator, 1.0))
