"""Run one planned step through the HF model: build the step's inputs
(:mod:`nopad.inference.step_inputs`: one host buffer, one copy), call the model once on the flat
row, and return the logits of the last token of every sequence that samples this step
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
import functools
import logging
from collections.abc import Iterator

import torch

from nopad.inference.graph_sampler import GraphDraw, forward_and_draw
from nopad.inference.kv_cache import KVCache
from nopad.inference.prompt_logprobs import PromptScorer
from nopad.inference.sampler import PendingSample
from nopad.inference.step_inputs import (
    DecodeRows,
    DeviceIds,
    StepInputs,
    build_static_decode,
    build_step,
    decode_step,
    is_decode,
)
from nopad.inference.step_plan import StepPlan
from nopad.packing import invariance

logger = logging.getLogger(__name__)


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
    for t in step.draw:
        mark(t, 0)


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
        # the static decode forward, which may draw the rows too (nopad.inference.graph_sampler)
        self.decode_forward = functools.partial(forward_and_draw, model)
        self.compiled = compile_decode
        # a steady decode batch's draws inside the compiled graph: on CUDA, where the sampler's kernels
        # after the graph were launches on the step's critical path; on CPU they are the same arithmetic,
        # which the eager ops do faster (benchmarks/bench_sampler.py --compiled-pick), so tests turn it on
        self.graph_draws = compile_decode and self.device.type == "cuda"
        self.static_steps = 0  # decode steps that ran padded to a bucket (for tests and stats)
        self.static_shapes: set[tuple[int, int]] = set()  # (rows, block-table width) buckets seen
        self._variants: set[tuple] = set()  # (bucket, DrawSpec or None) the compiled step has been called with
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
            self.decode_forward = torch.compile(self.decode_forward, mode="reduce-overhead" if cuda else None)

    @property
    def draws_in_graph(self) -> bool:
        """Whether a steady decode step's rows are drawn inside the compiled graph (:meth:`run` with
        ``draw``); not in :func:`nopad.packing.batch_invariant`, whose steps take the eager path."""
        return self.graph_draws and not invariance.is_enabled()

    @torch.no_grad()
    def run(
        self,
        plan: StepPlan,
        ids_from: DeviceIds | None = None,
        rows: DecodeRows | None = None,
        draw: GraphDraw | None = None,
    ) -> tuple[torch.Tensor | PendingSample, list[int]]:
        """Logits ``(num_sampling, vocab)`` and, for each, its index into ``plan.seqs``. ``ids_from``: a
        decode step whose input ids are the draws of the step still in flight (overlap scheduling);
        ``rows``: a pure decode step's host arrays, kept by its batch. ``draw`` (only when
        :attr:`draws_in_graph`): the rows' sampling inputs; the compiled step draws them and returns its
        draws in place of the logits."""
        self.kv_cache.copy_blocks(plan.copies)
        states = self.kv_cache.states  # hybrid models: nopad.inference.state_cache
        # each row's state slot (hybrid models); a first chunk's state starts from zero (a decode batch's
        # rows are past theirs)
        slots = None if states is None else rows.state_slots if rows is not None else [s.state_slot for s in plan.seqs]
        fresh = [] if states is None or rows is not None else [s.state_slot for s in plan.seqs if s.num_computed == 0]
        decode = rows is not None or ids_from is not None or is_decode(plan)
        if draw is not None and not (rows is not None and self.draws_in_graph):
            raise RuntimeError("a step drawn inside the graph needs a decode batch's rows and draws_in_graph")
        if self.static_decode and decode and not invariance.is_enabled():
            step = build_static_decode(
                rows if rows is not None else DecodeRows.of(plan, with_ids=ids_from is None),
                self.kv_cache.block_size,
                self.device,
                self.scratch_block,
                self.max_num_seqs,
                self.max_width,
                slots,
                None if states is None else states.scratch_slot,
                ids_from,
                draw,
            )
            self.static_steps += 1
            shape = tuple(step.meta.block_table.shape)
            variant = (shape, None if draw is None else draw.spec)  # logits, or the draws of a DrawSpec
            if self.compiled and variant not in self._variants:
                # marks matter only to a call that compiles, and a bucket seen before compiles nothing
                # (its guards accept unmarked tensors): 9 marks a step were ~40 Python calls
                _mark_dynamic(step)
                self._variants.add(variant)
            self.static_shapes.add(shape)
            if states is not None:  # a first token (a one-token prompt) starts from zero
                states.begin_static(step.state_index, fresh, step.meta)
            with _state_step(states):
                out = self.decode_forward(
                    None if draw is None else draw.spec,
                    step.draw,
                    input_ids=step.input_ids,
                    position_ids=step.position_ids,
                    use_cache=False,
                    nopad_meta=step.meta,
                    nopad_kv_cache=self.kv_cache,
                    nopad_backend=self.backend,
                )
            num = len(step.sampling_rows)
            return (out[:num] if draw is None else draw.pending(out, num)), step.sampling_rows
        if rows is not None:
            step = decode_step(rows, self.kv_cache.block_size, self.device, ids_from)
        else:
            step = build_step(plan, self.kv_cache.block_size, self.device, ids_from)
        if states is not None:  # a first chunk starts from zero
            states.begin(slots, fresh, list(plan.query_lens))
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
