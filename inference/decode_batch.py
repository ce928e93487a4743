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
built again from the running sequences: admissions, prefill chunks, preemption, forks, a tool episode's
resume, prompt log-probs still to score and unmet ``min_tokens``. Repetition penalties decode here, from
a device mask of each row's tokens that the step's own draws update (:mod:`nopad.inference.penalties`).
A hybrid model's rows keep their state slots (a running sequence's slot changes only where the general
step runs: preemption, forks). Tool episodes' turns decode here too: a turn's end goes to the sequence's
owner as in the general step (``hooks.turn_ended``: finish, or pause for its tools).

With overlap scheduling (:mod:`nopad.inference.overlap`) it keeps one step in flight: step N+1 is
launched on N's draws, still on the device, before N is read back and completed. A row whose draw at N
ends its turn by length is left out of N+1 (the arrays know its length); one that N's token stops
(a stop id or string) computes one token at N+1, which is dropped (``overlap_wasted_tokens``), as is the
N+1 token of an episode that paused at N and resumed before N+1 was read back.

Its outputs are the general step's, bit for bit: the same plan and input arrays, the same sampler
(:func:`nopad.inference.sampler.sample_on_device` given the rows' plan and their uniforms, both kept),
and the same stop rules (:meth:`nopad.inference.request.Sequence.stop_reason` decides for every row the
arrays flag: a length limit, a stop id, or stop strings of its own).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np
import torch

from nopad.inference.graph_sampler import DrawRows, GraphDraw
from nopad.inference.launched_step import Launched, masked, row_mask, rows_of
from nopad.inference.penalties import SeenTokens
from nopad.inference.request import Sequence, Status
from nopad.inference.sampler import Sampler
from nopad.inference.sampling_rows import RowsPlan, plan_rows
from nopad.inference.scheduler import Scheduler
from nopad.inference.seeding import stream_keys, uniform_draws
from nopad.inference.step_inputs import DecodeRows, DeviceIds
from nopad.inference.step_plan import StepPlan

if TYPE_CHECKING:
    from nopad.inference.live_model import LiveModel

NO_LIMIT = 1 << 62


class DecodeBatch:
    """The running sequences of a steady decode, as arrays (see the module's docstring). ``forward(plan,
    ids_from=, rows=, draw=)``: the generator's forward (:meth:`nopad.inference.model_runner.ModelRunner.run`);
    ``overlap``: keep a step in flight; ``live``: the model's device and vocabulary (a repetition penalty's
    mask is kept there, that wide; None: CPU, taken from the logits).
    :attr:`draws_in_graph` (set by the generator): whether a step's rows are drawn inside the compiled
    graph (:mod:`nopad.inference.graph_sampler`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        forward: Callable[..., tuple[torch.Tensor, list[int]]],
        sampler: Sampler,
        overlap: bool = False,
        live: LiveModel | None = None,
    ):
        self.scheduler, self.forward, self.sampler = scheduler, forward, sampler
        self.overlap = overlap
        self.device = torch.device("cpu") if live is None else live.device
        self.vocab_size = 0 if live is None else int(live.text_config.vocab_size)
        self.seen_tokens: SeenTokens | None = None  # allocated once, when a batch first has a penalty
        self.draws_in_graph: Callable[[], bool] = lambda: False  # the generator's runner says (draw=)
        self.seqs: list[Sequence] | None = None
        self.in_flight: Launched | None = None
        self.steps = 0  # steps it served (Generator.stats()["decode_batch_steps"])
        self.graph_steps = 0  # of which the compiled graph drew the rows (["graph_draw_steps"])

    def serve(self) -> bool:
        """Run the next step if it is a steady decode of the batch (True: with overlap, launch it and
        complete the one before); else complete any step in flight and leave the next to the general
        step (False)."""
        if not self.ready():
            self.drain()
            return False
        prev = self.in_flight
        if prev is None:
            launched = self._launch(None)
            if self.overlap:
                self.in_flight = launched
            else:
                self._complete(launched)
            return True
        # rows whose draw at prev ends their turn by length run no further (Sequence.stop_reason's rule)
        ended = (self.rows.positions + 1 >= self.limit).nonzero()[0]  # (not np.flatnonzero: 3 Python calls)
        if ended.size:
            self._drop(ended.tolist(), in_flight_ran=False)  # (prev appends them: they ran in it)
        if not self.seqs:  # every row ended at prev: nothing to launch before completing it
            self.drain()
            return True
        self.in_flight = self._launch(prev)
        self._complete(prev)  # prev's bookkeeping while the step after it computes
        if self.seqs is None:  # every row of the step just launched ended at prev: none of it is wanted
            launched, self.in_flight = self.in_flight, None
            self._complete(launched)
        return True

    def drain(self) -> None:
        """Complete the step in flight, if any (a pipeline break when the generator has work left)."""
        prev, self.in_flight = self.in_flight, None
        if prev is not None:
            self._complete(prev)
            self.scheduler.stats.overlap_breaks += int(self.scheduler.has_work())

    def ready(self) -> bool:
        """Whether it can serve the next step (it is built here when the batch changed)."""
        s = self.scheduler
        if s.waiting and len(s.running) + s.waiting[0].fork_count <= s.max_num_seqs:
            return False  # an admission to try: the general step plans it
        if self.seqs is None or s.stats.steps != self.seen_steps or s.running != self.seqs:
            if self.in_flight is not None:  # its rows changed between two steps (an abort): check each
                self.in_flight.clean = False
            if self.in_flight is not None or not self._build():
                self.seqs = None
                return False
        rows = self.rows
        out_of_room = int(np.count_nonzero(rows.positions >= rows.lens * s.block_size))
        return out_of_room <= s.allocator.num_free  # else the general step preempts

    # ----------------------------------------------------------------- a step
    def _launch(self, prev: Launched | None) -> Launched:
        """Reserve, forward, count the tokens computed, draw (on the device). ``prev``: the step in flight
        whose draws are this step's input ids."""
        s, rows, seqs = self.scheduler, self.rows, self.seqs
        bs, num = s.block_size, len(seqs)
        need = (rows.positions >= rows.lens * bs).nonzero()[0]
        if need.size:
            self._grow(need)
        plan = StepPlan(seqs=seqs, query_lens=[1] * num, num_decodes=num)
        s.count(plan)
        self.seen_steps, self.steps = s.stats.steps, self.steps + 1
        ids_from = None if prev is None else DeviceIds(prev.sample.tokens, self.prev_rows)
        draw = self._graph_draw() if self.draws_in_graph() else None
        out, _ = self.forward(plan, ids_from=ids_from, rows=rows, draw=draw)
        pos = rows.positions
        pos += 1  # computed: the token each row ran
        any(map(setattr, seqs, repeat("num_computed"), pos.tolist()))
        if s.enable_prefix_caching and prev is None:  # rows whose token filled a block (all on the host)
            filled = (pos // bs > self.hashed).nonzero()[0]
            if filled.size:
                s.register_full_blocks(*[seqs[r] for r in filled.tolist()])
                self.hashed[filled] = pos[filled] // bs
        if draw is not None:  # the graph drew the rows
            sample, self.graph_steps = out, self.graph_steps + 1
        else:
            plan_ = self.rows_plan
            if plan_ is None or plan_.vocab != out.shape[1]:
                # no min_tokens ban: a row still short of its min_tokens is not served here (servable), and
                # a row's tokens only grow (the sampler's per-row walk would be Python per row)
                plan_ = self.rows_plan = dataclasses.replace(plan_rows(seqs, out.shape[1]), bans=[])
                self.rand = np.asarray(plan_.rand, dtype=np.int64)
            uniforms = uniform_draws(self.keys[self.rand], pos[self.rand]) if plan_.rand else None  # pos: lengths
            penalties = None if self.penalties is None else self._penalties(out.shape[1])
            ahead = int(prev is not None)
            sample = self.sampler.draw(out, seqs, ahead, plan_, uniforms, penalties)
        if self.penalties is not None:  # each row's draw joins its history, on the device
            self.penalties.saw(sample.tokens)
        if prev is not None or self.overlap:
            s.stats.overlap_steps += 1
        self.prev_rows = np.arange(num, dtype=np.int64)  # the next step's input ids: these rows' draws
        return Launched(
            seqs, self.lists, self.arrival, self.limit, self.stop_ids, self.strings, self.tops, pos + 1, sample
        )

    def _graph_draw(self) -> GraphDraw:
        """A step the compiled graph draws, from the rows' kept parameters and random keys (the graph draws
        each row's uniform from its key and position, :mod:`nopad.inference.graph_sampler`)."""
        if self.draws is None:
            self.draws = DrawRows.of([q.request.params for q in self.seqs], self.keys)
        seen = None if self.penalties is None else self._penalties(self.vocab_size)
        return GraphDraw(self.draws, self.sampler.version(), seen)

    def _penalties(self, vocab: int) -> SeenTokens:
        """The batch's seen-token mask, for logits of ``vocab`` columns (made again from the rows' tokens
        in the rare model whose logits are not its configured vocabulary's width)."""
        if self.penalties.vocab != vocab:
            self.seen_tokens = self.penalties = SeenTokens(self.scheduler.max_num_seqs, vocab, self.device)
            self.penalties.fill(self.seqs)
        return self.penalties

    def _complete(self, step: Launched) -> None:
        """Read ``step``'s draws back, append them (rows that ended since its launch drop theirs), end the
        turns they end, and register the blocks their tokens complete (an overlapped step's)."""
        result = step.sample.result()
        now = time.perf_counter()
        if self.in_flight is None and self.seqs is not None:  # the last step launched: the next one's ids
            self.rows.ids = np.asarray(result.tokens, dtype=np.int64)[self.prev_rows]
        keep = None  # rows that ended since the launch drop their draws, as do episodes paused and resumed since
        if not step.clean:
            due = (step.lengths - 1).tolist()  # (a resumed episode's tokens grew past its draw's place)
            keep = np.array([q.status is Status.RUNNING and len(q.token_ids) == n for q, n in zip(step.seqs, due)])
            # (wasted: a finished row's; a paused one's token wrote the K/V its turn's last token needs)
            self.scheduler.stats.overlap_wasted_tokens += sum([q.status is Status.FINISHED for q in step.seqs])
        columns = [result.tokens, result.logprobs, result.temperature_logprobs, result.sampling_logprobs]
        tops = result.top_logprobs
        if keep is not None and not keep.all():
            step, columns = step.only(keep), [np.asarray(c)[keep].tolist() for c in columns]
            tops = [tops[i] for i in np.flatnonzero(keep).tolist()]
        tokens, versions, logprobs, tempered, sampling, times, top_lists = step.lists
        any(map(list.append, tokens, columns[0]))
        any(map(list.append, versions, repeat(result.policy_version, len(tokens))))
        any(map(list.append, logprobs, columns[1]))
        any(map(list.append, tempered, columns[2]))
        any(map(list.append, sampling, columns[3]))
        any(map(list.append, times, (now - step.arrival).tolist()))
        for i in () if step.tops is None else np.flatnonzero(step.tops).tolist():
            top_lists[i].append(tops[i])
        # rows whose turn may have ended: Sequence.stop_reason decides (a length limit, a stop id, a string)
        flagged = step.lengths >= step.limit
        if step.stop_ids is not None:
            flagged |= (np.asarray(columns[0], dtype=np.int64)[:, None] == step.stop_ids).any(axis=1)
        if step.strings is not None:
            flagged |= step.strings
        self._end_turns([step.seqs[r] for r in flagged.nonzero()[0].tolist()])
        if self.overlap and self.scheduler.enable_prefix_caching:  # blocks the step after computed
            s, bs = self.scheduler, self.scheduler.block_size
            full = [step.seqs[r] for r in (step.lengths % bs == 0).nonzero()[0].tolist()]
            s.register_full_blocks(*[seq for seq in full if seq.status is Status.RUNNING])

    def _end_turns(self, flagged: list[Sequence]) -> None:
        """Ask :meth:`Sequence.stop_reason` of every flagged row, in row order; hand the turns that end
        to their owner and drop those rows."""
        s, ended = self.scheduler, set()
        for seq in flagged:
            reason = seq.stop_reason(s.tokenizer, s.max_model_len)
            if reason is not None:
                seq.hooks.turn_ended(seq, reason)
                ended.add(id(seq))
        if ended and self.seqs is not None:
            self._drop([r for r, seq in enumerate(self.seqs) if id(seq) in ended])

    # ----------------------------------------------------------------- the arrays
    def servable(self, seqs: list[Sequence], ahead: int = 0) -> bool:
        """Whether every one of ``seqs`` is a plain decode this batch may serve. ``ahead``: each has drawn a
        token not appended yet (an overlapped general step in flight, :mod:`nopad.inference.overlap`,
        which asks before handing its rows over)."""
        s = self.scheduler
        if not seqs or len(seqs) > s.max_num_batched_tokens:
            return False
        bs, ref_count = s.block_size, s.allocator.ref_count
        for seq in seqs:  # a loop, not all(generator): no call per row
            request, p = seq.request, seq.request.params
            n = len(seq.token_ids) + ahead
            if seq.fork_count != 1 or n - seq.num_computed != 1:
                return False
            if seq.num_computed == 0:  # a one-token prompt's first step (a hybrid's state starts from zero)
                return False
            scored = request.prompt_logprobs  # prompt log-probs still to score (Request.scoring_prompt, inline)
            if scored is not None and len(scored) < len(request.prompt_token_ids):
                return False
            if p.min_tokens > 0 and n - seq.turn_start < p.min_tokens and request.stop_ids:
                return False
            first = seq.num_computed // bs  # the block its next token goes to must be its own
            if first < len(seq.block_table) and ref_count[seq.block_table[first]] > 1:
                return False
        return True

    def _build(self) -> bool:
        """The running sequences as arrays, if every one is a plain decode this batch may serve."""
        s = self.scheduler
        seqs = list(s.running)
        if not self.servable(seqs):
            return False
        if s.enable_prefix_caching:  # blocks an overlapped general step left unregistered
            s.register_full_blocks(*seqs)
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
        params = [q.request.params for q in seqs]
        self.strings = row_mask([bool(p.stop) for p in params])
        self.penalties = None  # rows with a repetition penalty: every row's tokens as a device mask
        if any([p.repetition_penalty != 1.0 for p in params]):
            if self.seen_tokens is None:
                s = self.scheduler
                self.seen_tokens = SeenTokens(s.max_num_seqs, self.vocab_size, self.device)
            self.penalties = self.seen_tokens
            self.penalties.fill(seqs)
        self.tops = row_mask([p.logprobs is not None for p in params])
        self.keys = stream_keys(seqs) if any([p.temperature != 0 for p in params]) else None
        self.draws: DrawRows | None = None  # what a compiled step drawing the rows reads (when one does)
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
        blocks = s.allocator.allocate_many(need.size)
        seqs = self.seqs
        any(map(list.append, [seqs[r].block_table for r in need.tolist()], blocks))
        rows.table[need, rows.lens[need]] = blocks
        rows.lens[need] += 1

    def _drop(self, ended: list[int], in_flight_ran: bool = True) -> None:
        """Rows ``ended`` leave the arrays; ``in_flight_ran``: they ran in the step in flight, which must
        not append to them (it appends only its rows still running)."""
        keep = np.ones(len(self.seqs), dtype=bool)
        keep[ended] = False
        if self.in_flight is not None and in_flight_ran:
            self.in_flight.clean = False
        seqs = [q for q, k in zip(self.seqs, keep.tolist()) if k]
        if not seqs:
            self.seqs = None
            return
        rows = self.rows
        rows.ids, rows.positions, rows.lens, rows.table = (
            rows.ids[keep],
            rows.positions[keep],
            rows.lens[keep],
            rows.table[keep],
        )
        if rows.state_slots is not None:
            rows.state_slots = [slot for slot, k in zip(rows.state_slots, keep.tolist()) if k]
        self.hashed, self.limit, self.arrival = self.hashed[keep], self.limit[keep], self.arrival[keep]
        self.prev_rows, self.stop_ids, self.keys = (
            self.prev_rows[keep],
            masked(self.stop_ids, keep),
            masked(self.keys, keep),
        )
        self.strings, self.tops = masked(self.strings, keep), masked(self.tops, keep)
        if self.penalties is not None:
            self.penalties.keep(keep)
        self.draws = None
        self.lists = rows_of(self.lists, keep)
        self.seqs, self.rows_plan = seqs, None
