"""Persistent step state: a batch that keeps decoding keeps its arrays from step to step.

While the same sequences decode step after step, what a step reads from each row (its input token,
position, blocks, stop limits, sampling parameters and random key) changes by one token. The general
step (plan, input build, sampler, postprocess) walks every row in Python each time: about 5 us a row,
ten times transformers' whole step outside the model at 256 rows. :class:`DecodeBatch` keeps those in
numpy arrays and touches a row in Python only when something happens to it: it needs a new block, it
fills one (the prefix cache registers it), or the arrays flag a possible end of its turn. The rest is
array arithmetic, and appends made by ``map`` in C.

It serves a step only when that step is a plain decode of exactly the scheduler's running sequences,
checked each step (the same list, no step planned elsewhere since its last, no admission possible,
blocks for every row that needs one). Everything else takes the general step, after which the batch is
built again from the running sequences: admissions, prefill chunks, preemption, forks, tool episodes,
hybrid models' state slots, repetition penalties, prompt log-probs and unmet ``min_tokens``.

Its outputs are the general step's, bit for bit: the same plan and input arrays, the same sampler
(:func:`nopad.inference.sampler.sample_on_device` given the rows' plan and their uniforms, both kept),
and the same stop rules (:meth:`nopad.inference.request.Sequence.stop_reason` decides for every row the
arrays flag, and for every row with stop strings).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import repeat

import numpy as np
import torch

from nopad.inference.request import Sequence
from nopad.inference.sampler import Sampler
from nopad.inference.sampling_rows import RowsPlan, plan_rows
from nopad.inference.scheduler import Scheduler
from nopad.inference.seeding import stream_keys, uniform_draws
from nopad.inference.step_inputs import DecodeRows
from nopad.inference.step_plan import StepPlan

NO_LIMIT = 1 << 62


class DecodeBatch:
    """The running sequences of a steady decode, as arrays (see the module's docstring). ``owner``: the
    hooks of the sequences it may serve (plain requests, whose turn end is their finish); ``forward(plan,
    rows=)``: the generator's forward (:meth:`nopad.inference.model_runner.ModelRunner.run`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        owner: object,
        forward: Callable[..., tuple[torch.Tensor, list[int]]],
        sampler: Sampler,
    ):
        self.scheduler, self.owner, self.forward, self.sampler = scheduler, owner, forward, sampler
        self.seqs: list[Sequence] | None = None
        self.steps = 0  # steps it served (Generator.stats()["decode_batch_steps"])

    def serve(self) -> bool:
        """Run the next step if it is a steady decode of the batch (True), else leave it to the general
        step (False)."""
        if not self.ready():
            return False
        self.step()
        return True

    def ready(self) -> bool:
        """Whether it can serve the next step (it is built here when the batch changed)."""
        s = self.scheduler
        if s.waiting and len(s.running) + s.waiting[0].fork_count <= s.max_num_seqs:
            return False  # an admission to try: the general step plans it
        if self.seqs is None or s.stats.steps != self.seen_steps or s.running != self.seqs:
            if not self._build():
                self.seqs = None
                return False
        rows = self.rows
        self.need = np.flatnonzero(rows.positions >= rows.lens * s.block_size)  # rows out of room
        return self.need.size <= s.allocator.num_free  # else the general step preempts

    def step(self) -> None:
        """One decode step of every row (after :meth:`ready` said yes): reserve, forward, sample, append,
        stop checks; turns that end go to their owner (``hooks.turn_ended``)."""
        s, rows, seqs = self.scheduler, self.rows, self.seqs
        bs, num = s.block_size, len(seqs)
        if self.need.size:
            self._grow(self.need)
        plan = StepPlan(seqs=seqs, query_lens=[1] * num, num_decodes=num)
        s.count(plan)
        self.seen_steps, self.steps = s.stats.steps, self.steps + 1
        logits, _ = self.forward(plan, rows=rows)
        now = time.perf_counter()
        pos = rows.positions
        pos += 1  # computed: the token each row ran
        any(map(setattr, seqs, repeat("num_computed"), pos.tolist()))
        if s.enable_prefix_caching:  # rows whose token filled a block
            for r in np.flatnonzero(pos // bs > self.hashed).tolist():
                s.register_full_blocks(seqs[r])
                self.hashed[r] = seqs[r].num_hashed
        plan_ = self.rows_plan
        if plan_ is None or plan_.vocab != logits.shape[1]:
            plan_ = self.rows_plan = plan_rows(seqs, logits.shape[1])
            self.rand = np.asarray(plan_.rand, dtype=np.int64)
        uniforms = uniform_draws(self.keys[self.rand], pos[self.rand]) if plan_.rand else None  # pos: their lengths
        result = self.sampler.draw(logits, seqs, rows_plan=plan_, uniforms=uniforms).result()
        self._append(result, now)
        rows.ids = np.array(result.tokens, dtype=np.int64)  # the next step's input ids
        self._end_turns(rows.ids, pos + 1)

    # ----------------------------------------------------------------- internals
    def _build(self) -> bool:
        """The running sequences as arrays, if every one is a plain decode this batch may serve."""
        s = self.scheduler
        seqs = list(s.running)
        if not seqs or len(seqs) > s.max_num_batched_tokens or s.state_slots is not None:
            return False
        owner, bs, ref_count = self.owner, s.block_size, s.allocator.ref_count
        for seq in seqs:  # a loop, not all(generator): no call per row
            request, p = seq.request, seq.request.params
            if seq.hooks is not owner or seq.fork_count != 1 or len(seq.token_ids) - seq.num_computed != 1:
                return False
            if p.repetition_penalty != 1.0 or request.prompt_logprobs is not None:
                return False
            if p.min_tokens > 0 and len(seq.token_ids) - seq.turn_start < p.min_tokens and request.stop_ids:
                return False
            first = seq.num_computed // bs  # the block its next token goes to must be its own
            if first < len(seq.block_table) and ref_count[seq.block_table[first]] > 1:
                return False
        self.seqs, self.seen_steps = seqs, s.stats.steps
        self.rows = DecodeRows.of(StepPlan(seqs=seqs, query_lens=[1] * len(seqs)))
        self.hashed = np.array([seq.num_hashed for seq in seqs], dtype=np.int64)
        self._per_row(seqs)
        return True

    def _per_row(self, seqs: list[Sequence]) -> None:
        """What the stop checks, the draws and the appends read from each row."""
        max_len = self.scheduler.max_model_len
        self.limit = np.array(
            [
                min(
                    q.turn_start + q.request.params.max_tokens,
                    max_len,
                    NO_LIMIT if q.max_generated is None else len(q.request.prompt_token_ids) + q.max_generated,
                )
                for q in seqs
            ],
            dtype=np.int64,
        )  # a row's turn ends by length once it holds this many tokens (Sequence.stop_reason's rules)
        stops = [sorted(q.request.stop_ids) for q in seqs]
        width = max(map(len, stops))
        self.stop_ids = np.full((len(seqs), width), -1, dtype=np.int64) if width else None
        if width:
            self.stop_ids[np.arange(width) < np.array(list(map(len, stops)))[:, None]] = np.fromiter(
                (t for row in stops for t in row), np.int64
            )
        self.string_rows = [i for i, q in enumerate(seqs) if q.request.params.stop]
        self.keys = stream_keys(seqs) if any([q.request.params.temperature != 0 for q in seqs]) else None
        self.rows_plan: RowsPlan | None = None
        self.arrival = np.array([q.request.arrival_time for q in seqs], dtype=np.float64)
        self.lists = [
            [q.token_ids for q in seqs],
            [q.policy_versions for q in seqs],
            [q.logprobs for q in seqs],
            [q.temperature_logprobs for q in seqs],
            [q.sampling_logprobs for q in seqs],
            [q.token_times for q in seqs],
            [q.top_logprobs for q in seqs],
        ]

    def _grow(self, need: np.ndarray) -> None:
        """A new block for each row in ``need`` (its last is full), in the table kept here too."""
        rows, s = self.rows, self.scheduler
        width = int(rows.lens[need].max()) + 1
        if width > rows.table.shape[1]:  # room for a few more blocks: not a copy every block
            rows.table = np.pad(rows.table, ((0, 0), (0, max(width, 2 * rows.table.shape[1]) - rows.table.shape[1])))
        for r in need.tolist():
            block = s.allocator.allocate()
            self.seqs[r].block_table.append(block)
            rows.table[r, rows.lens[r]] = block
        rows.lens[need] += 1

    def _append(self, result, now: float) -> None:
        """Append every row's draw, C-level (``list.append`` mapped over the rows' own lists)."""
        tokens, versions, logprobs, tempered, sampling, times, tops = self.lists
        any(map(list.append, tokens, result.tokens))
        any(map(list.append, versions, repeat(result.policy_version, len(tokens))))
        any(map(list.append, logprobs, result.logprobs))
        any(map(list.append, tempered, result.temperature_logprobs))
        any(map(list.append, sampling, result.sampling_logprobs))
        any(map(list.append, times, (now - self.arrival).tolist()))
        for i in self.rows_plan.top_rows:
            tops[i].append(result.top_logprobs[i])

    def _end_turns(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Ask :meth:`Sequence.stop_reason` of every row the arrays flag (a stop token, a length limit)
        and every row with stop strings; hand the turns that end to their owner, drop those rows."""
        flagged = lengths >= self.limit
        if self.stop_ids is not None:
            flagged |= (tokens[:, None] == self.stop_ids).any(axis=1)
        candidates = np.flatnonzero(flagged).tolist()
        if self.string_rows:
            candidates = sorted(set(candidates).union(self.string_rows))
        s, ended = self.scheduler, []
        for r in candidates:
            seq = self.seqs[r]
            reason = seq.stop_reason(s.tokenizer, s.max_model_len)
            if reason is not None:
                seq.hooks.turn_ended(seq, reason)
                ended.append(r)
        if ended:
            self._drop(ended)

    def _drop(self, ended: list[int]) -> None:
        """Rows whose turn ended leave the arrays (the batch is built afresh if the running list is not
        what is left)."""
        keep = np.ones(len(self.seqs), dtype=bool)
        keep[ended] = False
        seqs = [q for q, k in zip(self.seqs, keep.tolist()) if k]
        if not seqs or self.scheduler.running != seqs:
            self.seqs = None
            return
        rows, kept = self.rows, keep.tolist()
        rows.ids, rows.positions, rows.lens = rows.ids[keep], rows.positions[keep], rows.lens[keep]
        rows.table, self.hashed, self.limit, self.arrival = (
            rows.table[keep],
            self.hashed[keep],
            self.limit[keep],
            self.arrival[keep],
        )
        if self.stop_ids is not None:
            self.stop_ids = self.stop_ids[keep]
        if self.keys is not None:
            self.keys = self.keys[keep]
        if self.string_rows:
            at = np.cumsum(keep) - 1
            self.string_rows = [int(at[i]) for i in self.string_rows if kept[i]]
        self.lists = [[x for x, k in zip(column, kept) if k] for column in self.lists]
        self.seqs, self.rows_plan = seqs, None
