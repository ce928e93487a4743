"""A step's inputs, built on the host with numpy and moved to the device in ONE copy (pinned and
non-blocking on CUDA): token ids, positions, boundaries, slot mapping, block table and the rows whose
logits are kept. :func:`build_step` builds them from a plan's sequences, :func:`decode_step` from the
arrays a steady decode batch keeps (:mod:`nopad.inference.decode_batch`), and
:func:`build_static_decode` pads a pure decode step to a bucketed shape for a CUDA graph or
``torch.compile`` (:class:`nopad.inference.model_runner.ModelRunner` runs them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np
import torch

from nopad.inference.prompt_logprobs import Span, prompt_span
from nopad.inference.step_plan import StepPlan
from nopad.packing.layout import cumsum0, step_layout
from nopad.packing.varlen import VarlenMeta

if TYPE_CHECKING:
    from nopad.inference.graph_sampler import GraphDraw


@dataclass
class StepInputs:
    """A step's device tensors (views of one copied buffer) and host bookkeeping."""

    input_ids: torch.Tensor  # (1, T)
    meta: VarlenMeta
    logits_index: torch.Tensor | None  # flat token rows whose logits are needed (None: all)
    sampling_rows: list[int]  # plan.seqs index of each kept row
    position_ids: torch.Tensor | None = None  # (1, T)
    prompt_spans: list[Span] = field(default_factory=list)  # prompt rows kept after the sampling rows
    state_index: torch.Tensor | None = None  # static decode on hybrid models: each row's state slot
    draw: tuple[torch.Tensor, ...] = ()  # static decode drawn in the graph: its rows' inputs (GraphDraw.columns)


def _to_device(parts: list[np.ndarray], device) -> list[torch.Tensor]:
    """Device tensors of host arrays (int64; int32 for the varlen record's boundaries and block table;
    float64 for a drawn step's temperatures, uniforms, top-p and min-p), in ONE host-to-device copy: the int64 buffer
    of them all (a float64 part as its bits), pinned and non-blocking on CUDA, viewed there (an int32
    part cast on the device). On CPU a copy of each array (the step keeps its inputs while a decode
    batch updates its arrays in place), its own dtype, no torch op."""
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.from_numpy(a.copy()) for a in parts]
    return one_copy(parts, device)


def one_copy(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """:func:`_to_device`'s path for an accelerator: the parts packed in one int64 host buffer, one copy,
    viewed and cast on ``device`` (on CPU too, so a test holds the packing to the parts' values)."""
    sizes = [a.size for a in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = [a.reshape(-1).view(np.int64) if a.dtype == np.float64 else a.reshape(-1) for a in parts]
    np.concatenate(flat, out=host.numpy(), casting="safe")
    buf = host.to(device, non_blocking=True)
    views, at = [], 0
    for a, n in zip(parts, sizes):
        view = buf[at : at + n].view(a.shape)
        if a.dtype != np.int64:
            view = view.to(torch.int32) if a.dtype == np.int32 else view.view(torch.float64)
        views.append(view)
        at += n
    return views


@dataclass
class DeviceIds:
    """A decode step's input ids that are still on the device: row ``rows[i]`` of ``tokens`` (the
    draws of the step before, in flight: :mod:`nopad.inference.overlap`) is row ``i``'s input."""

    tokens: torch.Tensor
    rows: list[int]


def block_tables(seqs) -> tuple[np.ndarray, np.ndarray]:
    """The sequences' block tables as one ``(rows, longest)`` int64 array (0 after each row's blocks)
    and their lengths, in one numpy pass (no assignment per row)."""
    lens = np.array([len(s.block_table) for s in seqs], dtype=np.int64)
    table = np.zeros((len(seqs), int(lens.max())), dtype=np.int64)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
        chain.from_iterable([s.block_table for s in seqs]), np.int64, int(lens.sum())
    )
    return table, lens


@dataclass
class DecodeRows:
    """A pure decode step's host arrays, one entry per row: kept and updated in place from step to step
    by a batch that keeps decoding (:mod:`nopad.inference.decode_batch`), built from the plan otherwise."""

    ids: np.ndarray  # (n,) int64: each row's input token
    positions: np.ndarray  # (n,) int64: its position (tokens already in the cache)
    table: np.ndarray  # (n, width) int64: its blocks, the first lens[i] of row i (0 after them)
    lens: np.ndarray  # (n,) int64
    state_slots: list[int] | None = None  # hybrid models: each row's state slot

    @classmethod
    def of(cls, plan: StepPlan, with_ids: bool = True) -> DecodeRows:
        seqs = plan.seqs
        table, lens = block_tables(seqs)
        pos = np.array([s.num_computed for s in seqs], dtype=np.int64)
        ids = np.array([s.token_ids[s.num_computed] for s in seqs] if with_ids else np.zeros(len(seqs)), np.int64)
        slots = None if seqs[0].state_slot is None else [s.state_slot for s in seqs]
        return cls(ids, pos, table, lens, slots)


def _rows_part(ids_from: DeviceIds | None) -> list[np.ndarray]:
    return [] if ids_from is None else [np.asarray(ids_from.rows, dtype=np.int64)]


def _fill_ids(d_ids: torch.Tensor, ids_from: DeviceIds | None, d_rows: list[torch.Tensor]) -> None:
    """Write the in-flight draws into the step's input ids, on the device (no read-back)."""
    if ids_from is not None:
        rows = len(ids_from.rows)
        torch.index_select(ids_from.tokens, 0, d_rows[0], out=d_ids[:rows])


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_bucket(n: int) -> int:
    """Rows of a static decode step: 2, 4, 8, then multiples of 8 (as CUDA-graph engines bucket),
    so padding costs at most 7 rows of every linear layer, not up to half the batch. Not 1: dynamo
    specializes a size of 1, so a batch's last sequence alone would compile the step again."""
    return max(2, _pow2(n)) if n <= 8 else -(-n // 8) * 8


def build_step(plan: StepPlan, block_size: int, device, ids_from: DeviceIds | None = None) -> StepInputs:
    """The step's inputs, all device tensors from one host buffer and one copy. ``ids_from``: a decode
    step whose input ids are still on the device (an overlapped step's, :func:`device_ids`)."""
    lay = step_layout(plan.query_lens, [s.num_computed for s in plan.seqs])
    num, total = len(plan.seqs), int(lay["cu_q"][-1])
    # one numpy pass over all rows' tokens and blocks, not a numpy assignment per row (and lists,
    # not generators: a generator resumes, a Python call, once a row)
    if ids_from is not None:
        ids = np.zeros(total, dtype=np.int64)  # written on the device below
    else:
        ids = np.fromiter(
            chain.from_iterable(
                [s.token_ids[s.num_computed : s.num_computed + n] for s, n in zip(plan.seqs, plan.query_lens)]
            ),
            np.int64,
            total,
        )
    table, _ = block_tables(plan.seqs)
    if ids_from is not None:  # every row decodes its token on the device and samples
        sampling_rows = list(range(num))
    else:
        sampling_rows = [
            i
            for i, (seq, n) in enumerate(zip(plan.seqs, plan.query_lens))
            if seq.num_computed + n == len(seq.token_ids)
        ]
    keep = lay["cu_q"][1:][sampling_rows] - 1
    spans, prompt_rows = [], []  # prompt positions of requests asking for prompt log-probs
    for seq, n, at in zip(plan.seqs, plan.query_lens, lay["cu_q"][:-1]):
        if seq.request.prompt_logprobs is None:  # asked for none (prompt_span's first test, inline)
            continue
        span = prompt_span(seq, n)
        if span is not None:
            spans.append(span)
            prompt_rows.append(at + span[1] - 1 - seq.num_computed + np.arange(span[2]))
    keep = np.concatenate([keep, *prompt_rows])
    return _assemble(lay, ids, table, keep, sampling_rows, spans, block_size, device, ids_from)


def decode_step(rows: DecodeRows, block_size: int, device, ids_from: DeviceIds | None = None) -> StepInputs:
    """:func:`build_step` of a pure decode step from its kept host arrays (no walk over the rows)."""
    num, pos = rows.ids.size, rows.positions
    ones, rows_ = _decode_layout(num)
    k = pos + 1
    lay = dict(q=ones, k=k, cu_q=rows_, cu_k=cumsum0(k), positions=pos, seq_idx=rows_[:num])
    table = rows.table[:, : int(rows.lens.max())]
    return _assemble(lay, rows.ids, table, rows_[:num], list(range(num)), [], block_size, device, ids_from)


@lru_cache(maxsize=8)
def _decode_layout(num: int) -> tuple[np.ndarray, np.ndarray]:
    """A decode step's query lengths (ones) and ``arange(num + 1)`` (its cu_q; the first ``num``: its
    seq_idx and kept rows), the same for every step of ``num`` rows; read-only, as they are shared."""
    ones, rows_ = np.ones(num, dtype=np.int64), np.arange(num + 1, dtype=np.int64)
    ones.flags.writeable = rows_.flags.writeable = False
    return ones, rows_


def _assemble(
    lay: dict,
    ids: np.ndarray,
    table: np.ndarray,
    keep: np.ndarray,
    sampling_rows: list[int],
    spans: list[Span],
    block_size: int,
    device,
    ids_from: DeviceIds | None = None,
) -> StepInputs:
    """A step's device inputs from its host arrays: slot mapping, one copy, the varlen record."""
    pos = lay["positions"]
    slots = table[lay["seq_idx"], pos // block_size] * block_size + pos % block_size
    if keep.size == 0:  # only partial prefill chunks: no logits needed, still one forward
        keep = np.zeros(1, dtype=np.int64)
    i32 = np.int32
    parts = [ids, pos, slots, keep, table.astype(i32), np.stack([lay["cu_q"], lay["cu_k"]]).astype(i32)]
    parts.append(lay["seq_idx"].astype(i32))
    d_ids, d_pos, d_slots, d_keep, d_table, d_cu, d_seq, *d_rows = _to_device(parts + _rows_part(ids_from), device)
    _fill_ids(d_ids, ids_from, d_rows)
    q, k = lay["q"], lay["k"]
    meta = VarlenMeta(
        cu_seqlens_q=d_cu[0],
        cu_seqlens_k=d_cu[1],
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(k.max()),
        position_ids=d_pos,
        seq_idx=d_seq,
        seqlens_q=tuple(q.tolist()),
        seqlens_k=tuple(k.tolist()),
        block_table=d_table,
        slot_mapping=d_slots,
    )
    return StepInputs(d_ids[None], meta, d_keep, sampling_rows, position_ids=d_pos[None], prompt_spans=spans)


def is_decode(plan: StepPlan) -> bool:
    """Every sequence runs one token and samples from it (no prefill chunk)."""
    for s, n in zip(plan.seqs, plan.query_lens):  # a loop, not all(generator): no call per row
        if n != 1 or s.num_computed + 1 != len(s.token_ids):
            return False
    return True


def build_static_decode(
    rows: DecodeRows,
    block_size: int,
    device,
    scratch_block: int,
    max_num_seqs: int,
    max_width: int,
    state_slots: list[int] | None = None,
    scratch_state: int | None = None,
    ids_from: DeviceIds | None = None,
    draw: GraphDraw | None = None,
) -> StepInputs:
    """A pure decode step padded to ``(bucket(num_seqs), bucket(width))``: padding rows run token
    0 at position 0 with one key, written to and read from ``scratch_block``. A hybrid model's
    step (``state_slots`` of the rows, ``scratch_state`` the state cache's scratch slot) also gets each
    row's state slot, the padding rows' pointing at the scratch slot. A step drawn inside the graph
    (``draw``, :mod:`nopad.inference.graph_sampler`) gets its rows' sampling inputs (padding rows greedy).
    Ids, positions, context lengths,
    slots, block table (and state slots) come from one numpy pass and one copy (no numpy assignment per
    row, no device arithmetic outside the compiled forward: each is a launch the graph does not hold)."""
    num = rows.ids.size
    padded = min(row_bucket(num), max(max_num_seqs, num))
    lens = rows.lens
    width = int(lens.max())
    width = min(max(2, _pow2(width)), max(max_width, width))  # not 1 either (see row_bucket)
    table = np.full((padded, width), scratch_block, dtype=np.int64)
    w = min(width, rows.table.shape[1])
    table[:num, :w] = np.where(np.arange(w) < lens[:, None], rows.table[:, :w], scratch_block)
    pos = np.zeros(padded, dtype=np.int64)
    pos[:num] = rows.positions
    ids = np.zeros(padded, dtype=np.int64)
    if ids_from is None:  # else written on the device below
        ids[:num] = rows.ids
    slots = table[np.arange(padded), pos // block_size] * block_size + pos % block_size
    parts = [ids, pos, pos + 1, slots, table]
    if scratch_state is not None:
        state = np.full(padded, scratch_state, dtype=np.int64)
        state[:num] = state_slots
        parts.append(state)
    drawn = [] if draw is None else draw.columns(padded)
    d_ids, d_pos, d_lens, d_slots, d_table, *rest = _to_device(parts + drawn + _rows_part(ids_from), device)
    d_state = rest[:1] if scratch_state is not None else []
    d_draw = rest[len(d_state) : len(d_state) + len(drawn)]
    _fill_ids(d_ids, ids_from, rest[len(d_state) + len(drawn) :])
    meta = VarlenMeta.static_decode(d_table, d_lens, d_slots, position_ids=d_pos)
    return StepInputs(
        d_ids[None],
        meta,
        None,
        list(range(num)),
        position_ids=d_pos[None],
        state_index=d_state[0] if d_state else None,
        draw=tuple(d_draw) + (() if draw is None else draw.device_inputs()),
    )
