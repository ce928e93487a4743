"""What nopad's chunked varlen scans (the gated delta rule, Mamba2's SSD) share: the chunk-major
layout of a row's pieces, and a decay ``exp`` that never yields a subnormal float."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def chunk_layout(starts: Sequence[int], lengths: Sequence[int], total: int, chunk_size: int):
    """Where each piece's chunks go. Returns ``(index, active, order)``: ``index`` ``(C, chunk)``
    the row of each chunk position (``total``: a zero row), chunks chunk-major, pieces of most
    chunks first; ``active[j]`` how many pieces have a ``j``-th chunk; ``order`` the pieces in
    that order."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    chunks = -(-lengths // chunk_size)
    order = np.argsort(-chunks, kind="stable")
    starts, lengths, chunks = starts[order], lengths[order], chunks[order]
    width = int(chunks.max())
    offsets = np.arange(width)[:, None, None] * chunk_size + np.arange(chunk_size)[None, None, :]
    rows = starts[None, :, None] + offsets  # (width, pieces, chunk)
    rows = np.where(offsets < lengths[None, :, None], rows, total)
    present = np.arange(width)[:, None] < chunks[None, :]  # (width, pieces)
    return rows[present], present.sum(axis=1), order


FLUSH_BELOW = -70.0


def flushed_exp(log_decay: torch.Tensor) -> torch.Tensor:
    """``exp(log_decay)``, exactly 0 below ``exp(FLUSH_BELOW)`` (about 4e-31). A CPU multiplies
    subnormal floats (under 1.2e-38) tens of times slower than normal ones, and a strong decay's
    exponent reaches them within a chunk: on a random Qwen3.5 they cost most of the rule's time
    (its matmuls ran at 6 GFLOP/s). A term decayed by 4e-31 is far below fp32's resolution next to
    the token's own term (its decay is 1), so the output does not move by a bit that matters."""
    return log_decay.masked_fill(log_decay < FLUSH_BELOW, float("-inf")).exp()


def gather_chunks(row: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``row`` ``(T, ...)`` laid out as ``index`` ``(C, chunk)`` says: ``(C, chunk, ...)``, the
    positions past a piece's end (index ``T``) zero."""
    return torch.cat([row, row.new_zeros((1,) + row.shape[1:])])[index]


def piece_positions(index: np.ndarray, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """Where the pieces' rows, concatenated in piece order, sit in ``index`` flattened: what
    turns a chunk-major output back into the pieces' rows."""
    flat = index.reshape(-1)
    where = np.empty(int(flat.max()) + 1, dtype=np.int64)
    where[flat] = np.arange(flat.size)  # the zero row's entry is overwritten; it is never read
    return where[np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])]


def probe_inputs(shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Deterministic fp32 CPU tensors of these shapes (no RNG: a probe must not move the user's
    seed), for checking once that a chunked scan computes what transformers' function does."""
    return [torch.arange(int(np.prod(shape)), dtype=torch.float32).add(i).mul(0.7).sin().reshape(shape)
            for i, shape in enumerate(shapes)]
