"""The varlen metadata record: the one description of "which tokens belong to which sequence".

The training collator, the generator's step builder and every attention backend speak this one
type, so a packed training row and a paged generation step are the same thing to the core:
queries of sequence ``i`` are tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of the flat row, and
they attend to the ``seqlens_k[i]`` keys of that sequence, the causal mask aligned to the *end*
of the keys (a decode token is the last key; a prefill chunk is the tail of its context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from nopad.packing.layout import as_lengths, cumsum0, step_layout


class PaddedLayout(NamedTuple):
    """A row seen as a padded batch of its ``B`` sequences (:attr:`VarlenMeta.padded_layout`), int64
    tensors on the meta's device. Padding slots point at the sequence's first key / query row."""

    key_rows: torch.Tensor  # (B, max_k): row of each key in the flat keys
    query_rows: torch.Tensor | None  # (B, max_q): row of each query; None when one query per sequence
    query_valid: torch.Tensor  # (B, max_q) bool: a real query, not padding
    query_pos: torch.Tensor  # (B, max_q): each query's position among its sequence's keys
    key_lens: torch.Tensor  # (B,)


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    """Boundaries of the sequences in one flat row of tokens, for every attention backend.

    Tensors live on ``device``; ``seqlens_q``/``seqlens_k`` are host-side copies so CPU kernels
    can loop over sequences without a device sync. Values derived from the fields (index tensors,
    host arrays) are cached properties, built once per record - so once per forward or generator
    step, not once per layer.
    """

    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1], leading 0
    cu_seqlens_k: torch.Tensor  # int32 [num_seqs + 1], leading 0
    max_seqlen_q: int
    max_seqlen_k: int
    position_ids: torch.Tensor  # int64 [total_q]: position of each query token in its sequence
    seq_idx: torch.Tensor  # int32 [total_q]: which sequence each query token belongs to
    seqlens_q: tuple[int, ...] | None  # None only in a static decode step
    seqlens_k: tuple[int, ...] | None
    block_table: torch.Tensor | None = None  # int32 [num_seqs, max_blocks]: paged K/V blocks
    slot_mapping: torch.Tensor | None = None  # int64 [total_q]: cache slot of each new token's K/V
    # shared-prefix rows: key p of sequence i is row key_index[i, p] of the row's own K/V
    key_index: torch.Tensor | None = None  # int32 [num_seqs, max_seqlen_k] (a block table of 1-token blocks)
    key_rows: torch.Tensor | None = None  # int64 [total_k]: the same rows, sequence after sequence
    # static decode steps: one query per row, each row's key count on the device only
    context_lens: torch.Tensor | None = None  # int64 [rows]: keys of each row, the new token included

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_lengths(
        cls, lengths: Sequence[int] | np.ndarray | torch.Tensor, device: torch.device | str = "cpu"
    ) -> VarlenMeta:
        """A packed training row: each sequence attends to itself only (queries == keys)."""
        lens = as_lengths(lengths, "lengths")
        return cls.for_step(lens, np.zeros_like(lens), device=device)

    @classmethod
    def for_step(
        cls,
        query_lens: Sequence[int] | np.ndarray | torch.Tensor,
        context_lens: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        block_table: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> VarlenMeta:
        """A generation step: sequence ``i`` brings ``query_lens[i]`` new tokens on top of
        ``context_lens[i]`` already cached ones, so its keys are ``context + query`` long and
        its positions start at ``context_lens[i]``. Tensors go to ``device`` (default CPU, where
        collators build; code that builds a meta for a forward passes the query's device)."""
        lay = step_layout(query_lens, context_lens)
        q, k, cu_q, cu_k = lay["q"], lay["k"], lay["cu_q"], lay["cu_k"]
        positions, seq_idx = lay["positions"], lay["seq_idx"]
        total_q = int(cu_q[-1])
        if slot_mapping is not None and slot_mapping.numel() != total_q:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries but the step has {total_q} tokens")
        if block_table is not None and block_table.shape[0] != q.size:
            raise ValueError(f"block_table has {block_table.shape[0]} rows but the step has {q.size} sequences")
        dev = torch.device(device)
        return cls(
            cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
            cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)).to(dev),
            max_seqlen_q=int(q.max()) if q.size else 0,
            max_seqlen_k=int(k.max()) if k.size else 0,
            position_ids=torch.from_numpy(positions).to(dev),
            seq_idx=torch.from_numpy(seq_idx.astype(np.int32)).to(dev),
            seqlens_q=tuple(q.tolist()),
            seqlens_k=tuple(k.tolist()),
            block_table=None if block_table is None else block_table.to(dev, torch.int32),
            slot_mapping=None if slot_mapping is None else slot_mapping.to(dev, torch.int64),
        )

    @classmethod
    def shared_prefix(
        cls, groups: Sequence[tuple[int, Sequence[int]]], device: torch.device | str = "cpu"
    ) -> VarlenMeta:
        """A row where each group's prompt appears once, followed by its completions:
        ``groups = [(prompt_len, [completion_len, ...]), ...]`` lays out tokens
        ``[prompt, c1, c2, ..., next prompt, ...]``. The prompt is a sequence of its own
        (queries = keys = prompt); completion ``j`` is a sequence whose queries are its tokens and
        whose keys are the prompt's followed by its own, positions continuing after the prompt -
        the way the generator's n samples read one prompt's shared KV blocks. Keys are read in
        place through ``key_index`` (no copy of the prompt's K/V), so the prompt is computed once
        and receives the gradients of all its completions. A meta for attention tests and
        kernels; training rows are laid by :mod:`nopad.packing.bins.tree`."""
        q_lens, ctx_lens, key_lists = [], [], []
        start = 0
        for g, group in enumerate(groups):
            if len(group) != 2:
                raise ValueError(f"groups[{g}] must be (prompt_len, [completion_len, ...]), got {group!r}")
            prompt_len = int(group[0])
            completions = as_lengths(list(group[1]), f"groups[{g}] completions")
            if prompt_len < 1:
                raise ValueError(f"groups[{g}] has prompt_len {prompt_len}; a shared prefix needs >= 1 token")
            prompt_rows = np.arange(start, start + prompt_len, dtype=np.int64)
            q_lens.append(prompt_len)
            ctx_lens.append(0)
            key_lists.append(prompt_rows)
            start += prompt_len
            for c in completions.tolist():
                q_lens.append(c)
                ctx_lens.append(prompt_len)
                key_lists.append(np.concatenate([prompt_rows, np.arange(start, start + c, dtype=np.int64)]))
                start += c
        meta = cls.for_step(np.asarray(q_lens, dtype=np.int64), np.asarray(ctx_lens, dtype=np.int64), device=device)
        return meta.with_key_lists(key_lists)

    def with_key_lists(self, key_lists: Sequence[np.ndarray]) -> VarlenMeta:
        """This row with sequence ``i`` reading the row's own K/V rows ``key_lists[i]`` (its
        ``seqlens_k[i]`` keys, its queries last): the key index of shared-prefix and tree rows
        (:mod:`nopad.packing.bins.tree`)."""
        lens = [len(rows) for rows in key_lists]
        if tuple(lens) != self.seqlens_k:
            raise ValueError(f"key_lists have {lens} keys but the sequences {list(self.seqlens_k)}")
        index = np.zeros((len(key_lists), max(self.max_seqlen_k, 1)), dtype=np.int32)
        for i, rows in enumerate(key_lists):
            index[i, : len(rows)] = rows
        flat = np.concatenate(key_lists).astype(np.int64) if key_lists else np.zeros(0, dtype=np.int64)
        return replace(
            self, key_index=torch.from_numpy(index).to(self.device), key_rows=torch.from_numpy(flat).to(self.device)
        )

    @classmethod
    def static_decode(
        cls,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> VarlenMeta:
        """A decode step with static shapes (one query per row, a block table of fixed width), all
        on the device: nothing here is a Python number that depends on the context lengths, so a
        compiled or CUDA-graph forward serves every step of the same shape. Padding rows point at
        a scratch block and have length 1. Host-side lengths are unknown (``seqlens_k`` is None).
        ``position_ids``: ``context_lens - 1`` when the caller has it (no subtraction launched)."""
        rows = block_table.shape[0]
        if context_lens.shape != (rows,) or slot_mapping.shape != (rows,):
            raise ValueError(
                f"a static decode step needs context_lens and slot_mapping of shape ({rows},), "
                "got "
                f"{tuple(context_lens.shape)} and {tuple(slot_mapping.shape)}"
            )
        device = block_table.device
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_q,
            max_seqlen_q=1,
            max_seqlen_k=0,
            position_ids=context_lens - 1 if position_ids is None else position_ids,
            seq_idx=cu_q[:-1],
            seqlens_q=None,
            seqlens_k=None,
            block_table=block_table,
            slot_mapping=slot_mapping,
            context_lens=context_lens,
        )

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> VarlenMeta:
        """Recover sequence boundaries from packed ``position_ids`` (a new sequence starts
        wherever the position is 0), as transformers' own packed path does."""
        pos = position_ids.reshape(-1).detach().cpu().numpy().astype(np.int64)
        if pos.size == 0:
            return cls.from_lengths([], device=position_ids.device)
        starts = np.flatnonzero(pos == 0)
        if starts.size == 0 or starts[0] != 0:
            raise ValueError(
                "packed position_ids must start at 0 and restart at 0 for every sequence; "
                f"got first position {int(pos[0])}"
            )
        bounds = np.append(starts, pos.size)
        lengths = np.diff(bounds)
        expected = np.arange(pos.size) - np.repeat(starts, lengths)
        if not np.array_equal(pos, expected):
            bad = int(np.flatnonzero(pos != expected)[0])
            raise ValueError(
                f"position_ids are not 0,1,2,... within each packed sequence (token {bad} has "
                f"position {int(pos[bad])}, expected {int(expected[bad])})"
            )
        return cls.from_lengths(lengths, device=position_ids.device)

    # ----------------------------------------------------------------- views
    @property
    def is_static(self) -> bool:
        """A static decode step (:meth:`static_decode`): lengths on the device only."""
        return self.context_lens is not None

    @property
    def num_seqs(self) -> int:
        return self.position_ids.shape[0] if self.seqlens_q is None else len(self.seqlens_q)

    @property
    def total_q(self) -> int:
        return self.position_ids.shape[0] if self.seqlens_q is None else sum(self.seqlens_q)

    @property
    def total_k(self) -> int:
        return sum(self.seqlens_k)

    @property
    def is_prefill_only(self) -> bool:
        """True when queries == keys for every sequence (a training row or a fresh prefill)."""
        return self.seqlens_q == self.seqlens_k

    @cached_property
    def without_key_index(self) -> VarlenMeta:
        """This shared-prefix row once its keys are gathered (``key_rows``): a plain varlen row whose
        sequence ``i`` has ``seqlens_k[i]`` keys in order."""
        return replace(self, key_index=None, key_rows=None)

    def previous_rows(self) -> torch.Tensor:
        """Row of the token before each query token in its own sequence (its keys), -1 for a
        sequence's first token: the position whose logits predict that token. ``t - 1`` in a
        plain packed row; in a shared-prefix row a completion's first token is predicted by its
        prompt's last token."""
        cu_q = np.asarray(self.cu_seqlens_q.cpu(), dtype=np.int64)
        lens_q = np.asarray(self.seqlens_q, dtype=np.int64)
        lens_k = np.asarray(self.seqlens_k, dtype=np.int64)
        offset = np.arange(self.total_q, dtype=np.int64) - np.repeat(cu_q[:-1], lens_q)
        key_pos = offset + np.repeat(lens_k - lens_q, lens_q)  # each query's position among its keys
        if self.key_rows is None:
            if not self.is_prefill_only:
                raise ValueError("previous_rows needs every key in the row (a training or shared-prefix row)")
            prev = np.arange(self.total_q, dtype=np.int64) - 1
        else:
            cu_k = np.concatenate(([0], np.cumsum(lens_k)))
            flat = self.key_rows.cpu().numpy()
            prev = flat[np.maximum(np.repeat(cu_k[:-1], lens_q) + key_pos - 1, 0)] if flat.size else key_pos
        return torch.from_numpy(np.where(key_pos > 0, prev, -1)).to(self.device)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    @cached_property
    def key_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq, pos)`` (int64, on :attr:`device`) of every key of the row: which sequence it
        belongs to and its position there. Built on the host from ``seqlens_k`` and copied once
        (no ``repeat_interleave`` with a data-dependent size, no host sync)."""
        lens = np.asarray(self.seqlens_k, dtype=np.int64)
        seq = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
        pos = np.arange(seq.size, dtype=np.int64) - np.repeat(cumsum0(lens)[:-1], lens)
        both = torch.from_numpy(np.stack([seq, pos])).to(self.device, non_blocking=True)
        return both[0], both[1]

    @cached_property
    def seq_idx_long(self) -> torch.Tensor:
        """``seq_idx`` as int64 (for indexing)."""
        return self.seq_idx.to(torch.long)

    @cached_property
    def block_table_long(self) -> torch.Tensor:
        """``block_table`` as int64 (for indexing)."""
        if self.block_table is None:
            raise ValueError("this meta has no block_table")
        return self.block_table.to(torch.long)

    @cached_property
    def padded_layout(self) -> PaddedLayout:
        """This row as a padded batch ``(num_seqs, max_seqlen)``: built on the host from the
        lengths and copied once (what a padded attention call gathers, the same for every layer)."""
        lq = np.asarray(self.seqlens_q, dtype=np.int64)
        lk = np.asarray(self.seqlens_k, dtype=np.int64)
        k_off = np.arange(self.max_seqlen_k, dtype=np.int64)[None, :]
        q_off = np.arange(self.max_seqlen_q, dtype=np.int64)[None, :]
        key_rows = cumsum0(lk)[:-1, None] + np.where(k_off < lk[:, None], k_off, 0)
        valid = q_off < lq[:, None]
        query_rows = cumsum0(lq)[:-1, None] + np.where(valid, q_off, 0)
        query_pos = (lk - lq)[:, None] + q_off
        dev = self.device
        return PaddedLayout(
            key_rows=torch.from_numpy(key_rows).to(dev),
            query_rows=None if self.max_seqlen_q == 1 else torch.from_numpy(query_rows).to(dev),
            query_valid=torch.from_numpy(valid).to(dev),
            query_pos=torch.from_numpy(query_pos).to(dev),
            key_lens=torch.from_numpy(lk).to(dev),
        )

    @cached_property
    def host_boundaries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(cu_seqlens_q int32, seqlens_k int32, key starts int64)`` as host arrays, from the
        host lengths (no device sync): what a CPU kernel loops over."""
        cu_q = cumsum0(np.asarray(self.seqlens_q, dtype=np.int64)).astype(np.int32)
        lens_k = np.asarray(self.seqlens_k, dtype=np.int64)
        return cu_q, lens_k.astype(np.int32), cumsum0(lens_k)[:-1]

    @cached_property
    def host_block_table(self) -> np.ndarray:
        """``block_table`` as a contiguous int32 host array."""
        if self.block_table is None:
            raise ValueError("this meta has no block_table")
        return np.ascontiguousarray(self.block_table.detach().cpu().numpy(), dtype=np.int32)

    @cached_property
    def host_key_index(self) -> np.ndarray:
        """``key_index`` (a shared-prefix row's key rows) as a contiguous int32 host array."""
        if self.key_index is None:
            raise ValueError("this meta has no key_index (not a shared-prefix row)")
        return np.ascontiguousarray(self.key_index.detach().cpu().numpy(), dtype=np.int32)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VarlenMeta:
        """The same record with every tensor on ``device`` (dtypes kept: cu_seqlens and the block
        table stay int32). The one helper that moves a meta: batches (``move_batch``), DDP inputs
        and the attention layer (once per forward, through its plan) all use it."""
        dev = torch.device(device)
        if self.device == dev and all(
            t is None or t.device == dev for t in (self.block_table, self.key_index, self.key_rows)
        ):
            return self
        moved = {
            name: getattr(self, name).to(dev, non_blocking=non_blocking)
            for name in (
                "cu_seqlens_q",
                "cu_seqlens_k",
                "position_ids",
                "seq_idx",
                "block_table",
                "slot_mapping",
                "key_index",
                "key_rows",
                "context_lens",
            )
            if getattr(self, name) is not None
        }
        return replace(self, **moved)

    def __repr__(self) -> str:
        if self.is_static:
            return f"VarlenMeta(static decode, rows={self.num_seqs}, width={self.block_table.shape[1]})"
        n = self.num_seqs
        paged = ", paged" if self.block_table is not None else ""
        paged += ", shared prefix" if self.key_index is not None else ""
        return (
            f"VarlenMeta(num_seqs={n}, total_q={self.total_q}, total_k={self.total_k}, "
            f"max_seqlen_q={self.max_seqlen_q}, max_seqlen_k={self.max_seqlen_k}{paged})"
        )
