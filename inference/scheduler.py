"""The step planner: which sequences run in the next forward, with how many tokens each.

Every step is planned anew: running decodes first (one token each), then partly prefilled
sequences, then waiting ones, their prefill chunked into whatever is left of the token budget.
All of it becomes ONE varlen forward. When a decode needs a block and none is free, a sequence
is preempted by recompute: first an episode paused on its tools (most recently paused first),
then the most recently admitted running one. Its blocks are freed; a running one goes back to
the front of the queue with prompt + generated tokens as its new prefill, a paused one is
recomputed when its tools return. After the forward, :meth:`Scheduler.postprocess` owns the
step's bookkeeping (computed counts, prefix-cache registration, forks, the sampled tokens and
the turns they end); what a sequence's owner does at those events (collect an output, pause an
episode for its tools) is its :class:`nopad.inference.request.SequenceHooks`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from nopad.inference.request import Sequence, Status
from nopad.inference.seeding import fork_stream
from nopad.inference.state_cache import StateSlots
from nopad.inference.state_prefix import aligned_chunk, restore_snapshot, take_snapshot, usable_hits
from nopad.inference.step_plan import SchedulerStats, StepPlan
from nopad.packing.blocks import NO_PARENT, BlockAllocator, hash_block

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        state_slots: StateSlots | None = None,
        max_model_len: int = 1 << 62,
        tokenizer=None,
    ):
        self.allocator = allocator
        self.max_model_len, self.tokenizer = max_model_len, tokenizer  # a turn's stop checks
        self.block_size = allocator.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = max(1, int(watermark * allocator.num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.paused: list[Sequence] = []  # episodes waiting on tools, in pause order
        self.enable_prefix_caching = enable_prefix_caching
        self.state_slots = state_slots  # hybrid models: a sequence holds a state slot while it holds blocks
        self.stats = SchedulerStats()

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Sequences that can run now (paused ones wait for their tools)."""
        return bool(self.waiting or self.running)

    def poll_paused(self, block: bool) -> None:
        """Let the owners of paused sequences resume those whose work (tools) returned;
        ``block``: nothing else can run, so wait for one."""
        for hooks in {id(s.hooks): s.hooks for s in self.paused}.values():
            hooks.poll(block)

    # ----------------------------------------------------------------- planning
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        while True:
            self._plan(plan)
            if plan.seqs or not self.running:
                break
            # nothing fits though sequences run (their prefill chunks need blocks that others
            # hold): make room from the newest end, or stop a sequence that alone fills the cache
            if len(self.running) > 1:
                self.preempt(self.running[-1])
            else:
                self._finish_out_of_memory(self.running[0], plan)
        for seq in plan.stopped:
            seq.hooks.stopped(seq)
        if plan.seqs:
            self.count(plan)
        return plan

    def count(self, plan: StepPlan) -> None:
        self.stats.steps += 1
        self.stats.tokens_per_step.append(plan.num_tokens)
        self.stats.seqs_per_step.append(len(plan.seqs))
        self.stats.decode_tokens += plan.num_decodes
        self.stats.prefill_tokens += plan.num_tokens - plan.num_decodes

    def _plan(self, plan: StepPlan) -> None:
        budget = self.max_num_batched_tokens
        # 1. decodes, oldest first; preempt from the newest end when blocks run out
        i = prefilling = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if len(seq.token_ids) - seq.num_computed != 1:  # num_pending, inline: this walks every row
                prefilling += 1
                i += 1
                continue
            while not self.reserve(seq, 1, plan):
                victim = self._victim(seq)
                if victim is None:
                    self._finish_out_of_memory(seq, plan)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.seqs.append(seq)
                plan.query_lens.append(1)
                budget -= 1
                i += 1
                continue
            if seq.status is not Status.RUNNING:
                continue  # it left the running list; index i now holds the next one
            i += 1
        plan.num_decodes = len(plan.seqs)
        # 2. partly prefilled sequences (none if step 1 saw decodes only), then 3. new admissions
        for seq in list(self.running) if prefilling else ():
            if budget <= 0:
                break
            if seq.num_pending > 1:
                budget -= self._schedule_prefill(seq, budget, plan)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.running and sum(s.fork_count for s in self.running) + seq.fork_count > self.max_num_seqs:
                break
            taken = self._admit(seq, budget, plan)
            if not taken:
                # nothing else would run: paused episodes must not hold the cache hostage
                if not plan.seqs and self._preempt_a_paused():
                    continue
                break
            budget -= taken

    def _victim(self, seq: Sequence) -> Sequence | None:
        """Whom to preempt so that ``seq`` can grow: a paused episode holding blocks, else the
        newest running sequence; None when ``seq`` is alone with the whole cache."""
        for paused in reversed(self.paused):
            if paused.block_table:
                return paused
        if self.running[-1] is seq and len(self.running) == 1:
            return None
        return self.running[-1]

    def _preempt_a_paused(self) -> bool:
        for paused in reversed(self.paused):
            if paused.block_table:
                self.preempt(paused)
                return True
        return False

    def _admit(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """Move the head of the queue to running with a prefix-cache lookup and a first chunk."""
        alloc, bs = self.allocator, self.block_size
        # full blocks in the cache, keeping a token to compute (its logits); none for a prompt to score
        hits, parent = [], seq.last_hash
        for b in range(0 if seq.request.scoring_prompt else (seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[b * bs : (b + 1) * bs]
            h = hash_block(parent, tokens)
            block = alloc.lookup(h, tokens)
            if block is None:
                break
            hits.append((block, h))
            parent = h
        hits = usable_hits(self.state_slots, hits, seq)  # hybrid models: up to the last state snapshot
        revived = sum(1 for block, _ in hits if alloc.ref_count[block] == 0)
        computed = len(hits) * bs
        reserve = self.watermark_blocks if self.running else 0
        room = (alloc.num_free - revived - reserve) * bs  # token slots left for the new tokens
        chunk = aligned_chunk(self.state_slots, seq, computed, min(seq.num_tokens - computed, budget, room))
        if chunk <= 0 or (self.state_slots is not None and not self.state_slots.num_free):
            return 0
        for b, (block, h) in enumerate(hits):
            alloc.acquire_cached(h, seq.token_ids[b * bs : (b + 1) * bs])
            seq.block_table.append(block)
        seq.num_hashed = len(hits)
        seq.num_computed = computed
        if hits:
            seq.last_hash = hits[-1][1]
            self.stats.prefix_cache_hit_tokens += computed
        self.waiting.popleft()
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.acquire()
            restore_snapshot(self.state_slots, seq)
        seq.status = Status.RUNNING
        self.running.append(seq)
        ok = self.reserve(seq, chunk, plan)
        assert ok, "admission reserved blocks it had checked were free"
        plan.seqs.append(seq)
        plan.query_lens.append(chunk)
        return chunk

    def _schedule_prefill(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        bs = self.block_size
        room = len(seq.block_table) * bs - seq.num_computed + self.allocator.num_free * bs
        if seq.num_computed % bs and self.allocator.ref_count[seq.block_table[-1]] > 1:
            room -= bs  # the shared partial block must be copied first
        chunk = aligned_chunk(self.state_slots, seq, seq.num_computed, min(seq.num_pending, budget, room))
        if chunk <= 0 and self._preempt_a_paused():  # a resumed episode's tool tokens come first
            return self._schedule_prefill(seq, budget, plan)
        if chunk <= 0 or not self.reserve(seq, chunk, plan):
            return 0
        plan.seqs.append(seq)
        plan.query_lens.append(chunk)
        return chunk

    def reserve(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Give ``seq`` writable slots for its next ``num_new`` tokens, or return False."""
        alloc, bs, table = self.allocator, self.block_size, seq.block_table
        first = seq.num_computed // bs
        cow = first < len(table) and alloc.ref_count[table[first]] > 1
        grow = -(-(seq.num_computed + num_new) // bs) - len(table)  # blocks_for, inline: once a row a step
        if grow <= 0 and not cow:  # most decodes: the last block has room
            return True
        if grow + int(cow) > alloc.num_free:
            return False
        if cow:
            new, src = alloc.copy_on_write(table[first])
            table[first] = new
            plan.copies.append((src, new))
        for _ in range(grow):
            table.append(alloc.allocate())
        return True

    # ----------------------------------------------------------------- leaving
    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks. A running sequence goes back to the front of the queue to
        recompute prompt + generated; a paused one stays paused and recomputes when resumed."""
        self._release(seq)
        self.stats.preemptions += 1
        if seq.status is Status.PAUSED:
            self.stats.paused_preemptions += 1
        else:
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        logger.debug("preempted sequence %d (%d tokens)", seq.seq_id, seq.num_tokens)

    def pause(self, seq: Sequence) -> None:
        """Take a running episode out of the batch while its tools run; its blocks stay pinned."""
        self.running.remove(seq)
        seq.status = Status.PAUSED
        self.paused.append(seq)

    def resume(self, seq: Sequence, new_tokens: list[int], fork_count: int = 1) -> None:
        """Append ``new_tokens`` (a tool result) to a paused episode and let it run again: only
        those tokens are prefilled, or everything when it was preempted meanwhile."""
        self.paused.remove(seq)
        seq.token_ids.extend(new_tokens)
        seq.fork_count = fork_count
        if seq.block_table:
            seq.status = Status.RUNNING
            self.running.append(seq)
        else:
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.PAUSED:
            self.paused.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens (plus the one it samples next) can ever
        hold its K/V in this cache."""
        return self.allocator.blocks_for(num_tokens + 1) <= self.allocator.num_blocks

    def _finish_out_of_memory(self, seq: Sequence, plan: StepPlan) -> None:
        logger.warning(
            "sequence of request %s fills the whole KV cache (%d tokens, %d blocks of %d); stopping "
            "it with finish_reason='length'. Give the generator more KV memory for longer outputs.",
            seq.request.request_id,
            seq.num_tokens,
            self.allocator.num_blocks,
            self.block_size,
        )
        self.finish(seq, "length")
        seq.out_of_memory = True
        plan.stopped.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free_all(seq.block_table)
        seq.block_table = []
        if seq.state_slot is not None:  # a preempted sequence recomputes its state from its tokens
            self.state_slots.release(seq.state_slot)
            seq.state_slot = None
        seq.num_computed = 0
        seq.num_hashed = 0
        seq.last_hash = NO_PARENT

    # ----------------------------------------------------------------- after the forward
    def postprocess(
        self, plan: StepPlan, sampling_rows: list[int], draw: Callable[[list[int], list[Sequence]], object]
    ) -> None:
        """The one owner of a step's bookkeeping once its forward ran: count the computed tokens,
        register new full blocks in the prefix cache, split groups whose prefill completed into their
        forks (``hooks.forked``), draw a token for every sequence that samples now (``draw(logits rows,
        sequences)`` returns the sampler's ``SampleResult``; forks share their parent's row), append
        it, and end the turns it ends (``hooks.turn_ended``: finish, or pause for tools)."""
        now = time.perf_counter()
        self.computed(plan)
        to_sample: list[tuple[Sequence, int]] = []
        for row, i in enumerate(sampling_rows):
            seq = plan.seqs[i]
            group = self.fork(seq) if seq.fork_count > 1 else [seq]
            if len(group) > 1:
                seq.hooks.forked(seq, group[1:])
            # a member preempted for want of a state slot samples when it has recomputed (same draw)
            for s in group:  # a loop, not a generator: no call per row
                if s.status is Status.RUNNING:
                    to_sample.append((s, row))
        if not to_sample:
            return
        seqs = [seq for seq, _ in to_sample]
        result = draw([row for _, row in to_sample], seqs)
        self.append_sampled(list(enumerate(seqs)), result, now)

    def computed(self, plan: StepPlan) -> None:
        """The step's forward ran: count its tokens as computed, register the blocks they filled in
        the prefix cache, and snapshot hybrid states at block boundaries."""
        bs, slots = self.block_size, self.state_slots
        for seq, n in zip(plan.seqs, plan.query_lens):
            seq.num_computed += n
            if self.enable_prefix_caching and seq.num_computed // bs > seq.num_hashed:  # a block filled
                self.register_full_blocks(seq)
            if self.enable_prefix_caching and slots is not None:  # (no call per row when not)
                take_snapshot(slots, seq, n)

    def append_sampled(self, rows: list[tuple[int, Sequence]], result, now: float) -> None:
        """Append row ``k`` of the step's draws (a ``SampleResult``) to each ``(k, seq)`` and end the
        turns those tokens end (``hooks.turn_ended``: finish, or pause for tools)."""
        for k, seq in rows:
            seq.append(result, k, now)
            reason = seq.stop_reason(self.tokenizer, self.max_model_len)
            if reason is not None:
                seq.hooks.turn_ended(seq, reason)

    def register_full_blocks(self, *seqs: Sequence) -> None:
        """Put each sequence's newly computed full blocks in the prefix cache (only blocks whose tokens are
        all on the host: an overlapped step computes a token before it is appended); one call for many."""
        bs, register = self.block_size, self.allocator.register
        for seq in seqs:
            ids, computed = seq.token_ids, seq.num_computed
            for b in range(seq.num_hashed, (computed if computed < len(ids) else len(ids)) // bs):
                tokens = ids[b * bs : (b + 1) * bs]
                h = hash_block(seq.last_hash, tokens)
                register(seq.block_table[b], h, tokens)
                seq.last_hash = h
                seq.num_hashed = b + 1

    def fork(self, seq: Sequence) -> list[Sequence]:
        """Split a group into its ``fork_count`` members, sharing every block (and each taking a
        copy of the per-sequence state, hybrid models). Samples of a prompt take indices 1..n-1
        (their random stream is their index); an episode's later forks take streams derived
        from its own."""
        samples = [seq]
        later = seq.num_tokens > seq.num_prompt_tokens
        for index in range(1, seq.fork_count):
            stream = fork_stream(seq.stream, index, seq.num_tokens) if later else None
            child = seq.fork(index, stream)
            for block in child.block_table:
                self.allocator.share(block)
            self.stats.forked_shared_blocks += len(child.block_table)
            self.running.append(child)
            if self.state_slots is not None:
                self._give_state(child, seq)
            samples.append(child)
        seq.fork_count = 1
        return samples

    def _give_state(self, child: Sequence, parent: Sequence) -> None:
        """A fork's new member takes a slot holding a copy of the parent's state; with none free
        (resumed episodes forking can outnumber max_num_seqs) a paused episode is preempted, else
        the member itself: it recomputes its state from its tokens when readmitted, and samples
        then (its draw is keyed by its stream and position, so it is the same token)."""
        if not self.state_slots.num_free:
            self._preempt_a_paused()
        if not self.state_slots.num_free:
            self.preempt(child)
            return
        child.state_slot = self.state_slots.acquire()
        self.state_slots.copy(parent.state_slot, child.state_slot)

    def owners(self) -> list[list[int]]:
        """Block lists of every live sequence, for ``BlockAllocator.check(owners=...)``."""
        return [s.block_table for s in (*self.running, *self.waiting, *self.paused)]
