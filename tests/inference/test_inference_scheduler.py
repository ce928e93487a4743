"""The scheduler alone, on a fake runner: no model, every sampled token is given. Pins the order
in which sequences are preempted, the reference counts of forked blocks, and how a paused
sequence keeps, loses and recomputes its blocks; and that its postprocess calls the sequence's
owner (SequenceHooks) at each event."""

from __future__ import annotations

import itertools

from nopad.inference.request import Request, Sequence, Status
from nopad.inference.sampler import SampleResult
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.scheduler import Scheduler
from nopad.packing.blocks import BlockAllocator

STOP = 99
_ids = itertools.count()


class Owner:
    """A fake SequenceHooks that records every event; a turn end pauses when ``pause`` is set."""

    def __init__(self, scheduler: Scheduler, pause: bool = False):
        self.scheduler, self.pause, self.events = scheduler, pause, []

    def forked(self, parent, children):
        self.events.append(("forked", parent.seq_id, [c.index for c in children]))

    def turn_ended(self, seq, reason):
        self.events.append(("turn_ended", seq.seq_id, reason))
        if self.pause:
            self.scheduler.pause(seq)
        else:
            self.scheduler.finish(seq, reason)

    def stopped(self, seq):
        self.events.append(("stopped", seq.seq_id))

    def poll(self, block):
        self.events.append(("poll", block))


def scheduler_of(num_blocks: int, block_size: int = 2, **kwargs) -> Scheduler:
    return Scheduler(
        BlockAllocator(num_blocks, block_size),
        enable_prefix_caching=False,
        **kwargs,
        max_num_seqs=kwargs.pop("max_num_seqs", 8),
        max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 64),
    )


def add(scheduler: Scheduler, owner, prompt_len: int, n: int = 1, max_tokens: int = 16) -> Sequence:
    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, stop_token_ids=[STOP], ignore_eos=True)
    request = Request(str(next(_ids)), None, list(range(1, prompt_len + 1)), params, 0, 0.0, frozenset({STOP}))
    seq = Sequence(request=request, index=0, token_ids=list(request.prompt_token_ids), fork_count=n, hooks=owner)
    request.samples = [seq] + [None] * (n - 1)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler, token: int = 7):
    """One step on a fake runner: every sequence that completes its tokens samples ``token``."""
    plan = scheduler.schedule()
    rows = [
        i for i, (seq, n) in enumerate(zip(plan.seqs, plan.query_lens)) if seq.num_computed + n == seq.num_tokens
    ]  # what the model runner keeps logits for

    def draw(index, seqs):
        assert len(index) == len(seqs)
        k = len(seqs)
        return SampleResult(
            tokens=[token] * k,
            logprobs=[-1.0] * k,
            temperature_logprobs=[-1.0] * k,
            sampling_logprobs=[-1.0] * k,
            top_logprobs=[None] * k,
        )

    scheduler.postprocess(plan, rows, draw)
    scheduler.allocator.check(owners=scheduler.owners())
    return plan


def test_preemption_takes_a_paused_episode_first_then_the_newest_running():
    scheduler = scheduler_of(num_blocks=5)
    owner = Owner(scheduler)
    a, b, c, d = (add(scheduler, owner, prompt_len=2) for _ in range(4))
    plan = step(scheduler)
    assert plan.seqs == [a, b, c, d] and plan.query_lens == [2, 2, 2, 2]
    assert scheduler.allocator.num_free == 1  # each holds one full block; each now needs a second
    scheduler.pause(a)  # the oldest: an episode waiting on its tools, its block pinned
    plan = step(scheduler)
    # b takes the free block; c takes the paused a's; d, the newest running, yields its own
    assert plan.seqs == [b, c] and plan.query_lens == [1, 1]
    assert (a.status, a.block_table, a.num_computed) == (Status.PAUSED, [], 0)
    assert d.status is Status.WAITING and list(scheduler.waiting) == [d] and d.block_table == []
    assert d.num_tokens == 3 and d.num_pending == 3  # prompt + its token, recomputed on readmission
    assert (scheduler.stats.preemptions, scheduler.stats.paused_preemptions) == (2, 1)
    # a paused episode preempted meanwhile recomputes everything, ahead of the queue
    scheduler.resume(a, [5, 6])
    assert list(scheduler.waiting) == [a, d] and a.status is Status.WAITING and a.num_pending == 5


def test_a_sequence_alone_with_the_whole_cache_is_stopped_not_preempted():
    scheduler = scheduler_of(num_blocks=2)
    owner = Owner(scheduler)
    seq = add(scheduler, owner, prompt_len=3, max_tokens=16)
    step(scheduler)
    step(scheduler)
    assert seq.num_tokens == 5 and seq.status is Status.RUNNING
    step(scheduler)  # its fifth token needs a third block of two, and nothing can yield one
    assert seq.status is Status.FINISHED and seq.finish_reason == "length" and seq.out_of_memory
    assert owner.events[-1] == ("stopped", seq.seq_id)
    assert scheduler.stats.preemptions == 0 and scheduler.allocator.num_free == 2


def test_fork_shares_every_prompt_block_and_copies_the_partial_one_on_write():
    scheduler = scheduler_of(num_blocks=16)
    owner = Owner(scheduler)
    parent = add(scheduler, owner, prompt_len=5, n=3)  # blocks [2 tokens, 2 tokens, 1 token]
    step(scheduler)
    request = parent.request
    assert owner.events == [("forked", parent.seq_id, [1, 2])]
    children = [s for s in scheduler.running if s is not parent]
    assert [s.index for s in children] == [1, 2] and [s.stream for s in children] == [1, 2]
    assert all(s.block_table == parent.block_table for s in children)
    assert [scheduler.allocator.ref_count[b] for b in parent.block_table] == [3, 3, 3]
    assert scheduler.stats.forked_shared_blocks == 6
    assert all(s.token_ids == request.prompt_token_ids + [7] for s in (parent, *children))
    plan = step(scheduler)  # each writes its token into the shared partial block: two copy it
    assert len(plan.copies) == 2
    shared = parent.block_table[:2]
    assert [scheduler.allocator.ref_count[b] for b in shared] == [3, 3]
    assert len({s.block_table[2] for s in (parent, *children)}) == 3
    scheduler.finish(children[0], "abort")
    assert [scheduler.allocator.ref_count[b] for b in shared] == [2, 2]
    scheduler.finish(children[1], "abort")
    scheduler.finish(parent, "abort")
    assert scheduler.allocator.num_free == 16
    scheduler.allocator.check(owners=[])


def test_a_later_fork_takes_streams_derived_from_its_history():
    scheduler = scheduler_of(num_blocks=16)
    owner = Owner(scheduler, pause=True)
    seq = add(scheduler, owner, prompt_len=4, max_tokens=1)
    step(scheduler)  # max_tokens=1: the turn ends, the owner pauses it
    scheduler.resume(seq, [8, 9], fork_count=2)
    step(scheduler)
    (child,) = [s for s in scheduler.running if s is not seq] or [s for s in scheduler.paused if s is not seq]
    assert child.index == 1 and child.stream not in (0, 1)  # not a prompt sample's stream
    assert child.token_ids[:-1] == seq.token_ids[:-1]


def test_pause_keeps_the_blocks_and_resume_prefills_only_the_new_tokens():
    scheduler = scheduler_of(num_blocks=16)
    owner = Owner(scheduler, pause=True)
    seq = add(scheduler, owner, prompt_len=6)
    step(scheduler, token=STOP)  # a stop token ends the turn: the owner pauses the sequence
    assert owner.events == [("turn_ended", seq.seq_id, "stop")]
    assert seq.status is Status.PAUSED and scheduler.paused == [seq]
    blocks = list(seq.block_table)
    assert blocks and all(scheduler.allocator.ref_count[b] == 1 for b in blocks)
    plan = scheduler.schedule()
    assert plan.seqs == [] and not scheduler.has_work()  # nothing runs while it waits
    scheduler.poll_paused(block=True)
    assert owner.events[-1] == ("poll", True)
    scheduler.resume(seq, [11, 12, 13])
    assert seq.status is Status.RUNNING and seq.block_table[: len(blocks)] == blocks
    plan = step(scheduler)
    assert plan.seqs == [seq] and plan.query_lens == [4]  # its stop token and the three new ones
    assert seq.num_computed == 10 and seq.token_ids[-1] == 7


def test_postprocess_ends_a_turn_at_a_stop_token_and_at_max_tokens():
    scheduler = scheduler_of(num_blocks=16)
    owner = Owner(scheduler)
    short = add(scheduler, owner, prompt_len=3, max_tokens=2)
    stops = add(scheduler, owner, prompt_len=3, max_tokens=8)
    step(scheduler)
    step(scheduler)
    assert owner.events == [("turn_ended", short.seq_id, "length")]
    step(scheduler, token=STOP)
    assert owner.events[1:] == [("turn_ended", stops.seq_id, "stop")]
    assert short.finish_reason == "length" and stops.finish_reason == "stop"
    assert short.generated == [7, 7] and short.logprobs == [-1.0, -1.0]
    assert stops.generated == [7, 7, STOP]
    assert scheduler.allocator.num_free == 16 and not scheduler.has_work()


def test_the_scheduler_imports_neither_the_sampler_nor_the_model_side():
    """Seeding lives in nopad.inference.seeding; the scheduler plans and does the bookkeeping only."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "inference" / "scheduler.py").read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not modules & {
        "nopad.inference.sampler",
        "nopad.inference.model_runner",
        "nopad.inference.generator",
        "torch",
    }
