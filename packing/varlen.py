"""The varlen metadata record: the one description of "which tokens belong to which sequence".

The training collator, the generator's step builder and every attention backend speak this one
type, so a packed training row and a paged generation step are the same thing to the core:
queries of sequence ``i`` are tokens ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of the flat row, and
they attend to the ``seqlens_k[i]`` keys of that sequence, the causal mask aligned to the *end*
of the keys (a decode token is the last key; a prefill chunk is the tail of its context).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch


def _as_lengths(values: Sequence[int] | np.ndarray | torch.Tensor, name: str) -> np.ndarray:
    """Validate a 1-D array of non-negative integer lengths and return it as int64 numpy."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {arr[i]} is negative; lengths must be >= 0")
    return arr


def _cumsum0(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def step_layout(query_lens, context_lens) -> dict[str, np.ndarray]:
    """Host (numpy int64) arrays of a step's boundaries: ``q``/``k`` lengths, ``cu_q``/``cu_k``,
    each query token's ``positions`` and ``seq_idx``. Shared by :meth:`VarlenMeta.for_step` and
    the generator's step builder, which copies them to the device in one buffer."""
    q = _as_lengths(query_lens, "query_lens")
    ctx = _as_lengths(context_lens, "context_lens")
    if q.shape != ctx.shape:
        raise ValueError(
            f"query_lens and context_lens must have the same length, got {q.size} and {ctx.size}"
        )
    k = q + ctx
    cu_q, cu_k = _cumsum0(q), _cumsum0(k)
    total_q = int(cu_q[-1])
    if total_q >= 2**31 or int(cu_k[-1]) >= 2**31:
        raise ValueError("more than 2**31 tokens in one row; split the batch")
    seq_idx = np.repeat(np.arange(q.size, dtype=np.int64), q)
    # position of token t of sequence i = ctx[i] + (t - cu_q[i])
    positions = np.arange(total_q, dtype=np.int64) - np.repeat(cu_q[:-1] - ctx, q)
    return dict(q=q, k=k, cu_q=cu_q, cu_k=cu_k, positions=positions, seq_idx=seq_idx)


@dataclass(frozen=True, eq=False)
class VarlenMeta:
    """Boundaries of the sequences in one flat row of tokens, for every attention backend.

    Tensors live on ``device``; ``seqlens_q``/``seqlens_k`` are host-side copies so CPU kernels
    can loop over sequences without a device sync.
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
    # index tensors derived from the host lengths, built once per meta (not once per layer)
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)
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
        lens = _as_lengths(lengths, "lengths")
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
            raise ValueError(
                f"slot_mapping has {slot_mapping.numel()} entries but the step has {total_q} tokens"
            )
        if block_table is not None and block_table.shape[0] != q.size:
            raise ValueError(
                f"block_table has {block_table.shape[0]} rows but the step has {q.size} sequences"
            )
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
        and receives the gradients of all its completions."""
        q_lens, ctx_lens, key_lists = [], [], []
        start = 0
        for g, group in enumerate(groups):
            if len(group) != 2:
                raise ValueError(f"groups[{g}] must be (prompt_len, [completion_len, ...]), got {group!r}")
            prompt_len = int(group[0])
            completions = _as_lengths(list(group[1]), f"groups[{g}] completions")
            if prompt_len < 1:
                raise ValueError(f"groups[{g}] has prompt_len {prompt_len}; a shared prefix needs >= 1 "
                                 "token")
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
        meta = cls.for_step(np.asarray(q_lens, dtype=np.int64), np.asarray(ctx_lens, dtype=np.int64),
                            device=device)
        index = np.zeros((len(key_lists), max(meta.max_seqlen_k, 1)), dtype=np.int32)
        for i, rows in enumerate(key_lists):
            index[i, : rows.size] = rows
        flat = np.concatenate(key_lists) if key_lists else np.zeros(0, dtype=np.int64)
        dev = torch.device(device)
        return replace(meta, key_index=torch.from_numpy(index).to(dev),
                       key_rows=torch.from_numpy(flat).to(dev))

    @classmethod
    def static_decode(
        cls, block_table: torch.Tensor, context_lens: torch.Tensor, slot_mapping: torch.Tensor
    ) -> VarlenMeta:
        """A decode step with static shapes (one query per row, a block table of fixed width), all
        on the device: nothing here is a Python number that depends on the context lengths, so a
        compiled or CUDA-graph forward serves every step of the same shape. Padding rows point at
        a scratch block and have length 1. Host-side lengths are unknown (``seqlens_k`` is None)."""
        rows = block_table.shape[0]
        if context_lens.shape != (rows,) or slot_mapping.shape != (rows,):
            raise ValueError(f"a static decode step needs context_lens and slot_mapping of shape ({rows},), "
                             "got "
                             f"{tuple(context_lens.shape)} and {tuple(slot_mapping.shape)}")
        device = block_table.device
        cu_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, max_seqlen_q=1, max_seqlen_k=0,
            position_ids=context_lens - 1, seq_idx=cu_q[:-1], seqlens_q=None, seqlens_k=None,
            block_table=block_table, slot_mapping=slot_mapping, context_lens=context_lens,
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

    def without_key_index(self) -> VarlenMeta:
        """This shared-prefix row once its keys are gathered (``key_rows``): a plain varlen row whose
        sequence ``i`` has ``seqlens_k[i]`` keys in order. Built once per meta."""
        if "without_key_index" not in self._derived:
            self._derived["without_key_index"] = replace(self, key_index=None, key_rows=None)
        return self._derived["without_key_index"]

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
                raise ValueError("previous_rows needs every key in the row (a training or shared-prefix "
                                 "row)")
            prev = np.arange(self.total_q, dtype=np.int64) - 1
        else:
            cu_k = np.concatenate(([0], np.cumsum(lens_k)))
            flat = self.key_rows.cpu().numpy()
            prev = flat[np.maximum(np.repeat(cu_k[:-1], lens_q) + key_pos - 1, 0)] if flat.size else key_pos
        return torch.from_numpy(np.where(key_pos > 0, prev, -1)).to(self.device)

    @property
    def document_ids(self) -> torch.Tensor:
        """Sequence id of each query token, the ``document_id`` a FlexAttention mask compares."""
        return self.seq_idx

    def cu_seqlens_padded(self, multiple: int) -> torch.Tensor:
        """``cu_seqlens`` with every sequence's length rounded up to ``multiple``: the layout
        context parallelism (2 x CP size) and fixed-shape kernels expect."""
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        lens = np.asarray(self.seqlens_q, dtype=np.int64)
        padded = -(-lens // multiple) * multiple
        return torch.from_numpy(_cumsum0(padded).astype(np.int32)).to(self.cu_seqlens_q.device)

    def padded_to(self, multiple: int) -> VarlenMeta:
        """The same row with its token count rounded up to ``multiple`` by one trailing filler
        sequence, so shapes fall into a few buckets (CUDA graphs, ``torch.compile``). The
        filler attends only to itself; its outputs are to be ignored."""
        if multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {multiple}")
        if self.block_table is not None or self.key_index is not None or not self.is_prefill_only:
            raise ValueError("padded_to is for plain packed training rows, not paged generation steps "
                             "or shared-prefix rows")
        extra = -self.total_q % multiple
        if extra == 0:
            return self
        return VarlenMeta.from_lengths(
            list(self.seqlens_q) + [extra], device=self.cu_seqlens_q.device
        )

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    def key_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seq, pos)`` (int64, on :attr:`device`) of every key of the row: which sequence it
        belongs to and its position there. Built on the host from ``seqlens_k`` and copied once,
        then memoised, so every layer that gathers keys reuses it (no ``repeat_interleave`` with
        a data-dependent size, no host sync)."""
        if "key_positions" not in self._derived:
            lens = np.asarray(self.seqlens_k, dtype=np.int64)
            seq = np.repeat(np.arange(lens.size, dtype=np.int64), lens)
            pos = np.arange(seq.size, dtype=np.int64) - np.repeat(_cumsum0(lens)[:-1], lens)
            both = torch.from_numpy(np.stack([seq, pos])).to(self.device, non_blocking=True)
            self._derived["key_positions"] = (both[0], both[1])
        return self._derived["key_positions"]

    def seq_idx_long(self) -> torch.Tensor:
        """``seq_idx`` as int64 (for indexing), converted once per meta, not once per layer."""
        if "seq_idx_long" not in self._derived:
            self._derived["seq_idx_long"] = self.seq_idx.to(torch.long)
        return self._derived["seq_idx_long"]

    def block_table_long(self) -> torch.Tensor:
        """``block_table`` as int64 (for indexing), converted once per meta, not once per layer."""
        if self.block_table is None:
            raise ValueError("this meta has no block_table")
        if "block_table_long" not in self._derived:
            self._derived["block_table_long"] = self.block_table.to(torch.long)
        return self._derived["block_table_long"]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VarlenMeta:
        """The same record with every tensor on ``device`` (dtypes kept: cu_seqlens and the block
        table stay int32). The one helper that moves a meta: batches (``move_batch``), DDP inputs
        and the attention layer itself (a meta on another device than the query) all use it."""
        dev = torch.device(device)
        if self.device == dev and all(t is None or t.device == dev
                                      for t in (self.block_table, self.key_index, self.key_rows)):
            return self
        if ("moved", dev) in self._derived:  # every layer of a forward moves the same meta: once
            return self._derived[("moved", dev)]
        moved = {
            name: getattr(self, name).to(dev, non_blocking=non_blocking)
            for name in (
                "cu_seqlens_q", "cu_seqlens_k", "position_ids", "seq_idx",
                "block_table", "slot_mapping", "key_index", "key_rows", "context_lens",
            )
            if getattr(self, name) is not None
        }
        self._derived[("moved", dev)] = result = replace(self, **moved)
        return result

    def flash_kwargs(self) -> dict:
        """The varlen keyword arguments of ``flash_attn_varlen_func`` and of transformers'
        flash-attention path (``cu_seq_lens_q`` etc.)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens_q,
            "cu_seq_lens_k": self.cu_seqlens_k,
            "max_length_q": self.max_seqlen_q,
            "max_length_k": self.max_seqlen_k,
        }

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
