"""Run one planned step through the HF model: build the step's inputs (token ids, positions,
boundaries, slot mapping, block table, the rows whose logits are kept) on the host with numpy,
move them to the device in ONE copy (pinned and non-blocking on CUDA), call the model once on
the flat row, and return the logits of the last token of every sequence that samples this step
(the lm_head runs on those rows only; the prompt positions of requests that ask for prompt
log-probs are scored here, in chunks, by :mod:`nopad.inference.prompt_logprobs`).

With ``static_decode`` a pure decode step is padded to bucketed shapes (number of sequences
rounded up to 2, 4, 8 or a multiple of 8, block-table width to a power of two, at least 2) so its
forward can be captured as a CUDA graph or compiled (``compile_decode``: one ``torch.compile`` with the
rows and table width dynamic, ``mode="reduce-overhead"`` on CUDA, which records one CUDA graph per
bucket). Padding rows write their K/V to a reserved scratch block and their logits are dropped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from nopad.inference.kv_cache import KVCache
from nopad.inference.prompt_logprobs import PromptScorer, Span, prompt_span
from nopad.inference.step_plan import StepPlan
from nopad.packing import invariance
from nopad.packing.layout import step_layout
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)


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


def _to_device(parts: list[np.ndarray], device) -> list[torch.Tensor]:
    """Concatenate int64 host arrays into one buffer, copy it once, return device views."""
    sizes = [a.size for a in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
    np.concatenate([a.reshape(-1) for a in parts], out=host.numpy())
    buf = host.to(device, non_blocking=True)
    views, at = [], 0
    for a, n in zip(parts, sizes):
        views.append(buf[at : at + n].view(a.shape))
        at += n
    return views


@dataclass
class DeviceIds:
    """A decode step's input ids that are still on the device: row ``rows[i]`` of ``tokens`` (the
    draws of the step before, in flight: :mod:`nopad.inference.overlap`) is row ``i``'s input."""

    tokens: torch.Tensor
    rows: list[int]


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
    lens = np.array([len(s.block_table) for s in plan.seqs])
    table = np.zeros((num, int(lens.max())), dtype=np.int64)
    table[np.arange(table.shape[1]) < lens[:, None]] = np.fromiter(
        chain.from_iterable([s.block_table for s in plan.seqs]), np.int64, int(lens.sum())
    )
    pos = lay["positions"]
    slots = table[lay["seq_idx"], pos // block_size] * block_size + pos % block_size
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
    if keep.size == 0:  # only partial prefill chunks: no logits needed, still one forward
        keep = np.zeros(1, dtype=np.int64)
    parts = [ids, pos, slots, keep, table, np.stack([lay["cu_q"], lay["cu_k"]]), lay["seq_idx"]]
    d_ids, d_pos, d_slots, d_keep, d_table, d_cu, d_seq, *d_rows = _to_device(parts + _rows_part(ids_from), device)
    _fill_ids(d_ids, ids_from, d_rows)
    q, k = lay["q"], lay["k"]
    meta = VarlenMeta(
        cu_seqlens_q=d_cu[0].to(torch.int32),
        cu_seqlens_k=d_cu[1].to(torch.int32),
        max_seqlen_q=int(q.max()),
        max_seqlen_k=int(k.max()),
        position_ids=d_pos,
        seq_idx=d_seq.to(torch.int32),
        seqlens_q=tuple(q.tolist()),
        seqlens_k=tuple(k.tolist()),
        block_table=d_table.to(torch.int32),
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
    plan: StepPlan,
    block_size: int,
    device,
    scratch_block: int,
    max_num_seqs: int,
    max_width: int,
    scratch_state: int | None = None,
    ids_from: DeviceIds | None = None,
) -> StepInputs:
    """A pure decode step padded to ``(bucket(num_seqs), bucket(width))``: padding rows run token
    0 at position 0 with one key, written to and read from ``scratch_block``. A hybrid model's
    step (``scratch_state``, the state cache's scratch slot) also gets each row's state slot, the
    padding rows' pointing at the scratch slot. Ids, positions, context lengths, slots, block table
    (and state slots) come from one numpy pass and one copy (no numpy assignment per row, no device
    arithmetic outside the compiled forward: each is a launch the graph does not hold)."""
    seqs, num = plan.seqs, len(plan.seqs)
    rows = min(row_bucket(num), max(max_num_seqs, num))
    lens = np.array([len(s.block_table) for s in seqs])
    width = int(lens.max())
    width = min(max(2, _pow2(width)), max(max_width, width))  # not 1 either (see row_bucket)
    table = np.full((rows, width), scratch_block, dtype=np.int64)
    table[:num][np.arange(width) < lens[:, None]] = np.fromiter(
        chain.from_iterable([s.block_table for s in seqs]), np.int64, int(lens.sum())
    )
    pos = np.zeros(rows, dtype=np.int64)
    pos[:num] = [s.num_computed for s in seqs]
    ids = np.zeros(rows, dtype=np.int64)
    if ids_from is None:  # else written on the device below
        ids[:num] = [s.token_ids[s.num_computed] for s in seqs]
    slots = table[np.arange(rows), pos // block_size] * block_size + pos % block_size
    parts = [ids, pos, pos + 1, slots, table]
    if scratch_state is not None:
        state = np.full(rows, scratch_state, dtype=np.int64)
        state[:num] = [seq.state_slot for seq in seqs]
        parts.append(state)
    d_ids, d_pos, d_lens, d_slots, d_table, *rest = _to_device(parts + _rows_part(ids_from), device)
    d_state = rest[:1] if scratch_state is not None else []
    _fill_ids(d_ids, ids_from, rest[len(d_state) :])
    meta = VarlenMeta.static_decode(d_table, d_lens, d_slots, position_ids=d_pos)
    return StepInputs(
        d_ids[None], meta, None, list(range(num)), position_ids=d_pos[None], state_index=d_state[0] if d_state else None
    )


def _mark_dynamic(step: StepInputs) -> None:
    """Rows and block-table width of a static decode step as dynamic dimensions for torch.compile."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (step.input_ids, step.position_ids):
        mark(t, 1)
    meta = step.meta
    mark(meta.block_table, 0)
    mark(meta.block_table, 1)
    for t in (meta.context_lens, meta.slot_mapping, meta.position_ids, meta.seq_idx):
        mark(t, 0)
    mark(meta.cu_seqlens_q, 0)
    if step.state_index is not None:
        mark(step.state_index, 0)


def check_static_decode_backend(name: str) -> None:
    """A backend forced for a generator with ``static_decode`` must have a static-shape decode
    path: said when the generator is built, not at its first decode step."""
    from nopad.packing.attention.registry import backends

    if backends()[name].static_decode is None:
        able = sorted(n for n, b in backends().items() if b.static_decode is not None)
        raise ValueError(
            f"attn_backend={name!r} has no static-shape decode path, which static_decode=True "
            f"(and compile_decode) runs; use one that has ({', '.join(able)}), or static_decode="
            "False"
        )


class ModelRunner:
    """Owns nothing but references: the live model and the generator's KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: str | None = None,
        *,
        static_decode: bool = False,
        compile_decode: bool = False,
        max_num_seqs: int = 128,
        max_blocks_per_seq: int | None = None,
        scratch_block: int | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.backend = backend or "auto"  # "auto": NOPAD_ATTN_BACKEND, else choose_backend's rule
        self.static_decode = static_decode or compile_decode
        if self.static_decode and scratch_block is None:
            raise ValueError("static_decode needs a scratch_block in the KV cache for padding rows")
        self.scratch_block = scratch_block
        self.max_num_seqs = max_num_seqs
        self.max_width = max_blocks_per_seq or kv_cache.num_blocks
        self.decode_forward = model
        self.static_steps = 0  # decode steps that ran padded to a bucket (for tests and stats)
        self.static_shapes: set[tuple[int, int]] = set()  # (rows, block-table width) buckets seen
        if compile_decode:
            # the cache is mutated in place: a static address, so CUDA graphs use it, not a copy (a
            # new Generator's cache re-records a bucket's graph once, it does not recompile)
            states = kv_cache.states  # hybrid layers' state slots: mutated in place too
            for t in kv_cache.k + kv_cache.v + ([] if states is None else states.tensors):
                torch._dynamo.mark_static_address(t)
            # One compilation for every bucket, on every device: the step's rows and table width
            # are dynamic (_mark_dynamic). Compiled per bucket, a table crossing a power of two or
            # a preemption changing the rows recompiled the model mid-run (seconds per bucket on
            # CUDA, tens of seconds on CPU; dynamo gives up after 8). On CUDA, reduce-overhead then
            # records one CUDA graph per bucket shape from that one compilation.
            cuda = self.device.type == "cuda"
            self.decode_forward = torch.compile(model, mode="reduce-overhead" if cuda else None)

    @torch.no_grad()
    def run(self, plan: StepPlan, ids_from: DeviceIds | None = None) -> tuple[torch.Tensor, list[int]]:
        """Logits ``(num_sampling, vocab)`` and, for each, its index into ``plan.seqs``. ``ids_from``: a
        decode step whose input ids are the draws of the step still in flight (overlap scheduling)."""
        self.kv_cache.copy_blocks(plan.copies)
        states = self.kv_cache.states  # hybrid models: nopad.inference.state_cache
        fresh = [] if states is None else [s.state_slot for s in plan.seqs if s.num_computed == 0]
        decode = ids_from is not None or is_decode(plan)
        if self.static_decode and decode and not invariance.is_enabled():
            step = build_static_decode(
                plan,
                self.kv_cache.block_size,
                self.device,
                self.scratch_block,
                self.max_num_seqs,
                self.max_width,
                None if states is None else states.scratch_slot,
                ids_from,
            )
            self.static_steps += 1
            shape = tuple(step.meta.block_table.shape)
            if self.decode_forward is not self.model and shape not in self.static_shapes:
                # marks matter only to a call that compiles, and a bucket seen before compiles nothing
                # (its guards accept unmarked tensors): 9 marks a step were ~40 Python calls
                _mark_dynamic(step)
            self.static_shapes.add(shape)
            if states is not None:  # a first token (a one-token prompt) starts from zero
                states.begin_static(step.state_index, fresh, step.meta)
            with _state_step(states):
                out = self.decode_forward(
                    input_ids=step.input_ids,
                    position_ids=step.position_ids,
                    use_cache=False,
                    nopad_meta=step.meta,
                    nopad_kv_cache=self.kv_cache,
                    nopad_backend=self.backend,
                )
            return out.logits[0, : len(step.sampling_rows)], step.sampling_rows
        step = build_step(plan, self.kv_cache.block_size, self.device, ids_from)
        if states is not None:  # a first chunk starts from zero
            states.begin([s.state_slot for s in plan.seqs], fresh, list(plan.query_lens))
        scorer = PromptScorer(self.model, len(step.sampling_rows), step.prompt_spans)  # none: does nothing
        with _state_step(states), scorer.hooked():
            out = self.model(
                input_ids=step.input_ids,
                position_ids=step.position_ids,
                use_cache=False,
                logits_to_keep=step.logits_index,
                nopad_meta=step.meta,
                nopad_kv_cache=self.kv_cache,
                nopad_backend=self.backend,
            )
        logits, rows = out.logits[0], step.sampling_rows
        scorer.commit(logits)
        return logits[: len(rows)], rows


@contextlib.contextmanager
def _state_step(states) -> Iterator[None]:
    """Close a hybrid model's state step after its forward (checking every stateful layer ran),
    or forget it if the forward raised; nothing for an attention-only model."""
    try:
        yield
    except BaseException:
        if states is not None:
            states.abandon()
        raise
    if states is not None:
        states.end()
