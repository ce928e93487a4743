"""Causal-LM losses of packed rows, as SUMS: the optimizer step divides them by its GLOBAL count of
loss tokens (or sequences), over all micro-batches of the gradient-accumulation window on all
data-parallel ranks (:class:`nopad.training.accumulation.OptimizerStepper`).

Why sums: packed batches hold different numbers of loss tokens, so averaging per micro-batch (or
per rank) weights a token in a sparse batch more than one in a dense batch, and the gradient is
no longer the one of the unpacked run. Dividing every micro-batch's summed loss by the same global
count - and undoing the averaging that DDP / DeepSpeed / FSDP2 apply to gradients, which the
stepper does - gives exactly the gradient of ``mean over all loss tokens of the step``.

One optimizer step by hand (``nopad.training.sft_step`` is the same, with the row moved to the device)::

    stepper = OptimizerStepper(model, optimizer)             # DDP / FSDP2 model, or an Accelerator
    with stepper.window(micro_batches) as w:                 # divides by the global loss-token count
        for batch in micro_batches:
            with w.row():                                    # DDP: syncs on the last row only
                w.backward(row_nll_sum(model, batch))        # the chunked LM head: no T x V logits
        # or, from logits you already have: w.backward(row_loss_sum(logits, batch))

Per-sequence weighting: ``stepper.window(rows, COUNT_KEYS["sequence"])`` with
``row_nll_sum(model, batch, weighting="sequence")`` (``sft_step(..., weighting="sequence")``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from nopad.packing.head.chunked import nll_sum
from nopad.packing.row import IGNORE_INDEX, PackedRow, as_row

# what a window's loss is a mean over: the row count each weighting divides by
COUNT_KEYS = {"token": "num_loss_tokens", "sequence": "num_loss_seqs"}
WEIGHTINGS = tuple(COUNT_KEYS)


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


def row_loss_sum(logits: torch.Tensor, row: PackedRow | Mapping, *, weighting: str = "token") -> torch.Tensor:
    """Summed next-token cross-entropy of one packed row (fp32), from the logits of every position.

    A plain row is :func:`causal_lm_loss_sum`. A tree row (:mod:`nopad.packing.bins.tree`) reads each
    loss token's logits where its own sequence predicts it (:meth:`PackedRow.loss_tokens`) and
    counts it once per sequence that trains on it (its pairs), as the flat sequences would; with
    ``"sequence"`` each pair is weighted by 1 / (its sequence's pairs). :func:`row_nll_sum` is the
    same loss from the model, without the row's logits. ``row``: a row, or a dict with its keys."""
    row = as_row(row)
    if row.pair_tokens is None:
        return causal_lm_loss_sum(logits, row.labels, seq_idx=row.nopad_meta.seq_idx, weighting=weighting)
    _check_weighting(weighting)
    logits = logits.reshape(-1, logits.shape[-1])
    predict_at, targets = row.loss_tokens()
    predict_at, targets = predict_at.to(logits.device), targets.to(logits.device)
    losses = row.per_pair(F.cross_entropy(logits[predict_at].float(), targets, reduction="none"))
    return _weighted_sum(losses, row, predict_at, weighting)


def row_nll_sum(model: torch.nn.Module, row: PackedRow | Mapping, *, weighting: str = "token") -> torch.Tensor:
    """:func:`row_loss_sum` of ``row`` under ``model``, computed from the model's hidden states at
    the loss positions only, through the chunked LM head (:func:`nopad.packing.head.chunked.nll_sum`): the
    row's ``T x V`` logits never exist, and a tree row's shared token goes through the head once
    (weighted by the pairs that train on it)."""
    _check_weighting(weighting)
    row = as_row(row)
    predict_at, targets = row.loss_tokens()
    pairs = torch.ones(row.per_pair(targets).shape, dtype=torch.float32, device=targets.device)
    pair_weights = _weighted_sum(pairs, row, predict_at, weighting, reduce=False)
    if row.pair_tokens is None:
        weights = pair_weights
    else:  # a token's weight is the sum of its pairs'
        weights = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        weights.index_add_(0, row.pair_tokens.to(targets.device), pair_weights)
    return nll_sum(model, row.model_kwargs(), predict_at, targets, weights)


def _weighted_sum(
    losses: torch.Tensor, row: PackedRow, predict_at: torch.Tensor, weighting: str, *, reduce: bool = True
) -> torch.Tensor:
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
