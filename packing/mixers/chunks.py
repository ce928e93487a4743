"""What nopad's chunked varlen scans (the gated delta rule, Mamba2's SSD) share: the chunk-major
layout of a row's pieces, and a decay ``exp`` that never yields a subnormal float."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch


def chunk_layout(starts: Sequence[int], lengths: Sequence[int], total: int, chunk_size: int):
    """Where each piece's chunks go. Returns ``(index, active, order)``: ``index`` ``(C, chunk)``
    the row of each chunk position (``total``: a zero row), chunks chunk-major, pieces of most
    chunks first; ``active[j]`` how many pieces have a ``j``-th chunk; ``order`` the pieces in
    that order."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or (lengths < 0).any() or chunk_size < 1:
        raise ValueError(
            f"a chunked scan needs at least one piece of length >= 0 and a chunk size >= 1; got "
            f"lengths {lengths.tolist()} and chunk_size {chunk_size}"
        )
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


def piece_rows(starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """The pieces' rows of the row, concatenated in piece order."""
    return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])


def piece_positions(index: np.ndarray, starts: Sequence[int], lengths: Sequence[int]) -> np.ndarray:
    """Where the pieces' rows, concatenated in piece order, sit in ``index`` flattened: what
    turns a chunk-major output back into the pieces' rows."""
    flat = index.reshape(-1)
    where = np.empty(int(flat.max()) + 1, dtype=np.int64)
    where[flat] = np.arange(flat.size)  # the zero row's entry is overwritten; it is never read
    return where[piece_rows(starts, lengths)]


def carry_states(
    active: np.ndarray, order: np.ndarray, initial: torch.Tensor, step: Callable
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry each piece's state from chunk to chunk, as :func:`chunk_layout` lays the chunks out:
    ``initial`` ``(pieces, ...)`` in piece order; ``step(block, state)`` gets the slice of chunk
    ``j`` of the pieces still running (a prefix of the state batch) and returns that block's
    output and the states after it. Returns the outputs concatenated (chunk-major) and each
    piece's final state, in piece order."""
    device = initial.device
    state = initial[torch.from_numpy(order).to(device)]
    outs, finals, done, offset = [], [], state.shape[0], 0
    for n in active.tolist():
        if n < done:  # pieces that end here: their state is final
            finals.append(state[n:done])
            state, done = state[:n], n
        out, state = step(slice(offset, offset + n), state)
        outs.append(out)
        offset += n
    finals.append(state)
    return torch.cat(outs), torch.cat(finals[::-1])[torch.from_numpy(np.argsort(order)).to(device)]


def probe_inputs(shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Deterministic fp32 CPU tensors of these shapes (no RNG: a probe must not move the user's
    seed), for checking once that a chunked scan computes what transformers' function does."""
    return [
        torch.arange(int(np.prod(shape)), dtype=torch.float32).add(i).mul(0.7).sin().reshape(shape)
        for i, shape in enumerate(shapes)
    ]
