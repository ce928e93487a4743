"""Repetition penalties on the device: each row's tokens so far as a ``(rows, vocab)`` mask.

A repetition penalty divides the logit of every token a sequence already holds (prompt and output,
as HF and vLLM do) by the penalty when it is positive and multiplies it when it is negative. Read
from the host, that is the sequence's whole history every step: one penalised row kept a batch off
the decode batch's kept arrays, off overlap scheduling and out of the compiled graph. A mask needs
none of it: it is built once when the batch is (from the rows' tokens), and each step's draws,
still on the device, set one entry per row (:class:`SeenTokens`). :func:`penalize` is the one
arithmetic, used by the eager sampler (general step and decode batch) and inside the graph.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from nopad.inference.request import Sequence
from nopad.inference.sampler_memory import host_tensor


def penalize(x: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, vocab) with each row's ``seen`` tokens penalised by its ``penalty`` (rows,), fp32. A
    row whose penalty is 1 comes out unchanged, bit for bit (x / 1 and x * 1 are x)."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(x > 0, x / p, x * p), x)


def seen_mask(seqs: list[Sequence], vocab: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """``(len(seqs), vocab)`` bool, True where row i's sequence holds the token (``out``: written there):
    one host-to-device copy of the rows' (row, token) pairs, one scatter."""
    lens = [len(s.token_ids) for s in seqs]
    tokens = np.fromiter(chain.from_iterable([s.token_ids for s in seqs]), np.int64, sum(lens))
    rows = np.repeat(np.arange(len(seqs), dtype=np.int64), lens)
    mask = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=device) if out is None else out.zero_()
    pairs = torch.from_numpy(np.stack([rows, tokens]))
    if device.type == "cuda":
        pairs = pairs.pin_memory().to(device, non_blocking=True)
    mask[pairs[0], pairs[1]] = True
    return mask


def penalties_of(params: list, device: torch.device) -> torch.Tensor:
    """Each row's repetition penalty, fp32 on ``device`` (the dtype :func:`penalize` divides by)."""
    return host_tensor([float(p.repetition_penalty) for p in params], torch.float32, device)


class SeenTokens:
    """A decode batch's rows' tokens as a device mask, and their penalties, kept from step to step.

    Its buffers are allocated once, for ``capacity`` rows (the most a batch holds, at least the rows a
    compiled step is padded to), so a compiled step always reads the same tensors; a batch uses the
    first rows (:meth:`rows`), and what lies past them is never read for a row that is kept."""

    def __init__(self, capacity: int, vocab: int, device: torch.device):
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
        self.penalty = torch.ones(capacity, dtype=torch.float32, device=device)
        self.num = 0

    @property
    def vocab(self) -> int:
        return self.seen.shape[1]

    def fill(self, seqs: list[Sequence]) -> None:
        """The rows of a batch built anew: each sequence's tokens and penalty."""
        self.num = len(seqs)
        seen_mask(seqs, self.vocab, self.seen.device, out=self.seen[: self.num])
        self.penalty[: self.num] = penalties_of([q.request.params for q in seqs], self.seen.device)

    def rows(self, padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mask and penalties of the batch's rows (``padded``: of that many, the rows past the batch's
        a compiled step's padding, whose draws are dropped)."""
        n = self.num if padded is None else padded
        return self.seen[:n], self.penalty[:n]

    def saw(self, tokens: torch.Tensor) -> None:
        """Each row drew ``tokens[row]`` (on the device, not read back): it is in the row's history now."""
        n = self.num
        self.seen[torch.arange(n, device=tokens.device), tokens[:n]] = True

    def keep(self, keep: np.ndarray) -> None:
        """Only the rows ``keep`` (a boolean mask over the batch's rows) stay, in order, at the front."""
        kept = torch.from_numpy(keep.nonzero()[0]).to(self.seen.device)
        self.seen[: kept.numel()] = self.seen[kept]
        self.penalty[: kept.numel()] = self.penalty[kept]
        self.num = kept.numel()
