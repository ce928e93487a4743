"""Overlap scheduling: launch decode step N+1 before step N's tokens reach the host.

A serial step builds its inputs, runs the forward, samples, reads the tokens back, then does the
bookkeeping (append, stop checks, streaming, prefix-cache inserts) while the device waits. With
``Generator(overlap=True)`` a pure decode step is left in flight with its draws on the device
(:class:`InFlight`); the next step's forward takes those draws as its input ids, and only then is
step N read back and completed, while N+1 computes. Each sequence of N is assumed to continue; one
that stopped at N computes one more token at N+1, which is dropped there (its text, ids, log-probs
and stop reason all come from N); one whose draw at N ends it by length is not run at N+1.

The pipeline breaks (N is completed before the next step is planned) wherever the next plan needs N's
results or changes the batch: a queued or resumed sequence to admit, a preemption (a block must be freed
first), a fork, a prefill chunk, prompt log-probs still to score, a repetition penalty (the general step
reads every token), a weight update (:meth:`nopad.inference.Generator.update_weights` completes the step
first). ``SchedulerStats.overlap_breaks`` counts them against ``overlap_steps``.

Everything exact is kept: draws are keyed by sequence and position (:mod:`nopad.inference.seeding`),
not by step, so the tokens, log-probs and their order do not change.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nopad.inference.decode_batch import DecodeBatch
from nopad.inference.request import Sequence, Status
from nopad.inference.sampler import PendingSample
from nopad.inference.scheduler import Scheduler
from nopad.inference.step_inputs import DeviceIds
from nopad.inference.step_plan import StepPlan


@dataclass
class InFlight:
    """A launched decode step whose draws are still on the device."""

    plan: StepPlan
    sample: PendingSample
    lengths: list[int]  # each row's len(token_ids) when its draw is due: a row whose sequence changed drops it


def pipelinable(plan: StepPlan) -> bool:
    """Whether the step after ``plan`` may be launched before ``plan``'s draws reach the host: a pure
    decode step (every row one token, sampling), no group to fork, nothing read from the host tokens."""
    for seq, n in zip(plan.seqs, plan.query_lens):  # a loop, not all(generator): no call per row
        request = seq.request
        if n != 1 or seq.num_computed != len(seq.token_ids) - 1 or seq.fork_count != 1:
            return False
        if request.params.repetition_penalty != 1.0:
            return False
        scored = request.prompt_logprobs  # prompt log-probs still to score (Request.scoring_prompt, inline)
        if scored is not None and len(scored) < len(request.prompt_token_ids):
            return False
    return True


def resolve_overlap(overlap: bool | None) -> bool:
    """``Generator(overlap=...)``: a bool, or None for the ``NOPAD_OVERLAP`` environment variable (1 or
    0), else off."""
    if overlap is not None:
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True, False or None (NOPAD_OVERLAP decides), got {overlap!r}")
        return overlap
    value = os.environ.get("NOPAD_OVERLAP", "0")
    if value not in ("0", "1"):
        raise ValueError(f"NOPAD_OVERLAP must be 0 or 1, got {value!r}")
    return value == "1"


class Pipeline:
    """A generator's one overlapped decode step in flight, and how the next step follows it.

    ``forward(plan, ids_from)`` runs a step's forward (logits, sampling rows); ``draw(logits, seqs,
    ahead)`` samples on the device (:func:`nopad.inference.sampler.sample_on_device`). ``batch``: the
    generator's decode batch, whose own step in flight (:mod:`nopad.inference.decode_batch`) is drained
    and forgotten with this one's."""

    def __init__(
        self,
        scheduler: Scheduler,
        forward: Callable[[StepPlan, DeviceIds | None], tuple[torch.Tensor, list[int]]],
        draw: Callable[[torch.Tensor, list[Sequence], int], PendingSample],
        batch: DecodeBatch | None = None,
    ):
        self.scheduler, self.forward, self.draw, self.batch = scheduler, forward, draw, batch
        self.in_flight: InFlight | None = None
        self._handed_at: int | None = None  # the batch's step count when it was last handed the rows

    @property
    def busy(self) -> bool:
        """A step is in flight (this pipeline's or the decode batch's)."""
        return self.in_flight is not None or (self.batch is not None and self.batch.in_flight is not None)

    def forget(self) -> None:
        """Drop the steps in flight unread (every row they ran was aborted)."""
        self.in_flight = None
        if self.batch is not None:
            self.batch.in_flight = None

    def launch(self, plan: StepPlan, prev: InFlight | None = None) -> None:
        """Run a pure decode step and draw its tokens, leaving them on the device; ``prev``: the step
        in flight whose draws are this step's input ids (each row's length grows by one before this
        step's draws are appended)."""
        ids_from = None if prev is None else DeviceIds(prev.sample.tokens, input_rows(prev, plan))
        logits, _ = self.forward(plan, ids_from)
        self.scheduler.computed(plan)
        self.scheduler.stats.overlap_steps += 1
        ahead = int(prev is not None)
        drawn = self.draw(logits, plan.seqs, ahead)
        self.in_flight = InFlight(plan, drawn, [len(seq.token_ids) + ahead for seq in plan.seqs])

    def advance(self) -> bool:
        """With a step N in flight, launch N+1 on its draws and complete N while N+1 computes (True);
        where the pipeline must break, complete N and return False: the caller plans afresh."""
        prev, self.in_flight = self.in_flight, None
        if prev is None:
            return False
        if self._hand_over(prev):  # the decode batch serves the next step, and keeps its own in flight
            complete(self.scheduler, prev)
            self.scheduler.stats.overlap_breaks += 1
            return False
        plan = continue_decodes(self.scheduler, prev)
        if plan is None or not plan.seqs:
            complete(self.scheduler, prev)
            self.scheduler.stats.overlap_breaks += int(plan is None and self.scheduler.has_work())
            return False
        self.launch(plan, prev)
        complete(self.scheduler, prev)  # N's bookkeeping while N+1 computes
        if not any(seq.status is Status.RUNNING for seq in plan.seqs):
            self.drain(count=False)  # every row ended at N: nothing of N+1 is wanted
        return True

    def _hand_over(self, prev: InFlight) -> bool:
        """Whether the decode batch would serve the step after ``prev`` (its rows, each one token ahead):
        then the rows go to it, whose step keeps their arrays (:mod:`nopad.inference.decode_batch`), rather
        than this general step, which walks every row each step. Why: after an admission or a fork (a
        GRPO group's n samples) this pipeline took every later step, and the batch never served again.
        Asked again only once the batch has served since its last hand-over (no break every step when
        it refuses)."""
        batch, s = self.batch, self.scheduler
        if batch is None or batch.steps == self._handed_at or s.waiting or len(s.running) != len(prev.plan.seqs):
            return False
        if not batch.servable(s.running, ahead=1):
            return False
        self._handed_at = batch.steps
        return True

    def drain(self, count: bool = True) -> None:
        """Complete the step in flight, if any (a break, when the generator still has work)."""
        if self.batch is not None:
            self.batch.drain()
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            complete(self.scheduler, prev)
            self.scheduler.stats.overlap_breaks += int(count and self.scheduler.has_work())


def continue_decodes(scheduler: Scheduler, prev: InFlight) -> StepPlan | None:
    """The next decode step of ``prev``'s sequences, each on the token ``prev`` drew, or None where the
    pipeline must break: something waits to be admitted, the batch changed, a block cannot be had."""
    if scheduler.waiting or len(scheduler.running) != len(prev.plan.seqs):
        return None
    plan, max_len, bs = StepPlan(), scheduler.max_model_len, scheduler.block_size
    ref_count, need = scheduler.allocator.ref_count, 0
    for k, seq in enumerate(prev.plan.seqs):
        if seq.status is not Status.RUNNING or len(seq.token_ids) != prev.lengths[k]:
            return None
        # its draw at prev ends its turn by length (Sequence.stop_reason's rules, inline: no call per
        # row): no step past its end
        n, params = len(seq.token_ids) + 1, seq.request.params
        if n >= max_len or n - seq.turn_start >= params.max_tokens:
            continue
        if seq.max_generated is not None and n - len(seq.request.prompt_token_ids) >= seq.max_generated:
            continue
        plan.seqs.append(seq)
        # a new block when the last is full, or a copy of a shared one: checked for every row before
        # any is reserved (a reservation is not undone, and a copy-on-write must reach a forward)
        first, table = seq.num_computed // bs, seq.block_table
        if first >= len(table) or ref_count[table[first]] > 1:
            need += 1
    if need > scheduler.allocator.num_free:
        return None
    for seq in plan.seqs:
        ok = scheduler.reserve(seq, 1, plan)
        assert ok, "a decode reserved blocks it had counted as free"
    plan.query_lens = [1] * len(plan.seqs)
    plan.num_decodes = len(plan.seqs)
    if plan.seqs:
        scheduler.count(plan)
    return plan


def input_rows(prev: InFlight, plan: StepPlan) -> list[int]:
    """For each row of ``plan`` (a :func:`continue_decodes` step), its row in ``prev``: where its input id is."""
    at = {seq.seq_id: k for k, seq in enumerate(prev.plan.seqs)}
    return [at[seq.seq_id] for seq in plan.seqs]


def complete(scheduler: Scheduler, step: InFlight) -> None:
    """Read ``step``'s draws back (its one sync) and append them: stop checks, streaming, the blocks
    they fill, the turns they end. A row whose sequence stopped, paused, resumed or was aborted
    since the launch drops its draw."""
    result = step.sample.result()
    now = time.perf_counter()
    rows: list[tuple[int, Sequence]] = []
    for k, seq in enumerate(step.plan.seqs):
        if seq.status is Status.RUNNING and len(seq.token_ids) == step.lengths[k]:
            rows.append((k, seq))
        elif seq.status is Status.FINISHED:  # (a paused one's token is not lost: its K/V is kept)
            scheduler.stats.overlap_wasted_tokens += 1
    scheduler.append_sampled(rows, result, now)
    if scheduler.enable_prefix_caching:  # blocks the step after computed, whose last token is now here
        bs = scheduler.block_size
        for _, seq in rows:
            computed, known = seq.num_computed, len(seq.token_ids)
            if seq.status is Status.RUNNING and (computed if computed < known else known) // bs > seq.num_hashed:
                scheduler.register_full_blocks(seq)
