"""Repetition penalties without the host: each row's tokens so far kept where the step's draws land.

A repetition penalty divides the logit of every token a sequence already holds (prompt and output,
as HF and vLLM do) by the penalty when it is positive and multiplies it when it is negative. Read
from the host, that is the sequence's whole history every step: one penalised row kept a batch off
the decode batch's kept arrays, off overlap scheduling and out of the compiled graph.
:class:`SeenTokens` keeps the rows' tokens instead, built once when the batch is and extended by each
step's draws while they are still on the device, in one of two forms:

- ``(row, token)`` pairs, on CPU: the penalty touches only the logits it changes (a dense mask costs
  passes over every row's whole vocabulary: 6-7x the pairs' time on one core, ``bench_sampler.py``);
- a ``(rows, vocab)`` mask, on an accelerator and inside a compiled step: fixed shapes, no host sync,
  and the passes are cheap there.

Both apply the same arithmetic (:func:`_penalized`), so either gives the general step's bits.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from nopad.inference.request import Sequence
from nopad.inference.sampler_memory import host_tensor


def _penalized(v: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The one arithmetic: positive logits divided by the penalty, the others multiplied (fp32)."""
    return torch.where(v > 0, v / penalty, v * penalty)


def penalize(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, vocab) with each row's ``seen`` tokens (a bool mask) penalised by its ``penalty``
    (rows,), fp32. A row whose penalty is 1 comes out unchanged, bit for bit (x / 1 and x * 1 are x)."""
    return torch.where(seen, _penalized(x, penalty[:, None]), x)


def penalize_pairs(x: torch.Tensor, pairs: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """:func:`penalize` with the seen tokens as ``(2, P)`` (row, token) pairs, a pair repeated or not (each
    entry is computed from ``x``, so a repeat writes the same value); a new tensor."""
    rows, tokens = pairs
    out = x.clone()
    out[rows, tokens] = _penalized(x[rows, tokens], penalty[rows])
    return out


def token_pairs(seqs: list[Sequence], device: torch.device, rows: list[int] | None = None) -> torch.Tensor:
    """``(2, P)`` int64 on ``device``: a (row, token) pair for every token of every sequence (prompt and
    output), sequence ``i`` being row ``rows[i]`` (default ``i``), in one host-to-device copy."""
    lens = [len(s.token_ids) for s in seqs]
    tokens = np.fromiter(chain.from_iterable([s.token_ids for s in seqs]), np.int64, sum(lens))
    index = np.arange(len(seqs), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    pairs = torch.from_numpy(np.stack([np.repeat(index, lens), tokens]))
    if device.type == "cuda":  # (pinned and non-blocking, as the step's inputs go)
        return pairs.pin_memory().to(device, non_blocking=True)
    return pairs.to(device)


def penalties_of(params: list, device: torch.device) -> torch.Tensor:
    """Each row's repetition penalty, fp32 on ``device`` (the dtype :func:`penalize` divides by)."""
    return host_tensor([float(p.repetition_penalty) for p in params], torch.float32, device)


class SeenTokens:
    """A decode batch's rows' tokens and penalties, kept from step to step (see the module's docstring).

    Its buffers are allocated once, for ``capacity`` rows (the most a batch holds, at least the rows a
    compiled step is padded to), and marked as static addresses: a compiled step reads the same tensors
    every step, in place (a CUDA graph copies no input of tens of MB per replay). A batch uses the first
    rows; what lies past them is never read for a row that is kept. The mask is made the first time a
    step asks for it (:meth:`graph_inputs`), on CPU only for a compiled step."""

    def __init__(self, capacity: int, vocab: int, device: torch.device):
        self.capacity, self.vocab, self.device = capacity, vocab, device
        self.penalty = torch.ones(capacity, dtype=torch.float32, device=device)
        torch._dynamo.mark_static_address(self.penalty)
        self.pairs: torch.Tensor | None = None  # (2, P) on CPU
        self.mask: torch.Tensor | None = None  # (capacity, vocab) bool
        self.num = 0

    def fill(self, seqs: list[Sequence]) -> None:
        """The rows of a batch built anew: each sequence's tokens and penalty."""
        self.num = len(seqs)
        self.penalty[: self.num] = penalties_of([q.request.params for q in seqs], self.device)
        pairs = token_pairs(seqs, self.device)
        self.pairs = pairs if self.device.type == "cpu" else None
        if self.mask is not None or self.device.type != "cpu":
            self._fill_mask(pairs)

    def _fill_mask(self, pairs: torch.Tensor) -> None:
        if self.mask is None:
            self.mask = torch.zeros(self.capacity, self.vocab, dtype=torch.bool, device=self.device)
            torch._dynamo.mark_static_address(self.mask)
        self.mask[: self.num] = False
        self.mask[pairs[0], pairs[1]] = True

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's logits ``x`` (its rows, in order) with each row's penalty applied."""
        if self.pairs is not None:
            return penalize_pairs(x, self.pairs, self.penalty)
        return penalize(x, self.mask[: self.num], self.penalty[: self.num])

    def graph_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole mask and penalties, for a compiled step, which reads its rows' (its padding rows'
        draws are dropped): the buffers themselves, not views, so their static addresses hold."""
        if self.mask is None:
            self._fill_mask(self.pairs)
        return self.mask, self.penalty

    def saw(self, tokens: torch.Tensor) -> None:
        """Each row drew ``tokens[row]`` (on the device, not read back): it is in the row's history now."""
        rows = torch.arange(self.num, device=tokens.device)
        if self.pairs is not None:
            self.pairs = torch.cat([self.pairs, torch.stack([rows, tokens[: self.num]])], dim=1)
        if self.mask is not None:
            self.mask[rows, tokens[: self.num]] = True

    def keep(self, keep: np.ndarray) -> None:
        """Only the rows ``keep`` (a boolean mask over the batch's rows) stay, in order, at the front."""
        kept = keep.nonzero()[0]
        if self.pairs is not None:  # (on CPU: a selection of data-dependent size is no sync there)
            new_row = torch.full((self.num,), -1, dtype=torch.int64)
            new_row[torch.from_numpy(kept)] = torch.arange(kept.size)
            rows = new_row[self.pairs[0]]
            stays = rows >= 0
            self.pairs = torch.stack([rows[stays], self.pairs[1][stays]])
        index = torch.from_numpy(kept).to(self.device)
        if self.mask is not None:
            self.mask[: kept.size] = self.mask[index]
        self.penalty[: kept.size] = self.penalty[index]
        self.num = kept.size
