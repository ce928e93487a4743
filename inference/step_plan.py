"""What the scheduler hands out and counts: :class:`StepPlan`, one forward's sequences and their token
counts, and :class:`SchedulerStats`, the running totals of steps, preemptions and tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from nopad.inference.request import Sequence


@dataclass
class StepPlan:
    """One forward: ``seqs[i]`` runs ``query_lens[i]`` tokens; ``copies`` are (src, dst) blocks
    to copy before the forward (copy-on-write)."""

    seqs: list[Sequence] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    num_decodes: int = 0
    stopped: list[Sequence] = field(default_factory=list)  # finished for lack of memory while planning

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


@dataclass
class SchedulerStats:
    steps: int = 0
    preemptions: int = 0
    paused_preemptions: int = 0  # of which paused episodes (their KV recomputed on resume)
    forked_shared_blocks: int = 0  # blocks a fork's new members share instead of recomputing
    prefix_cache_hit_tokens: int = 0
    prefill_tokens: int = 0  # prompt/recompute tokens actually run through the model
    decode_tokens: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    seqs_per_step: list[int] = field(default_factory=list)  # batch occupancy per step
    overlap_steps: int = 0  # decode steps launched before the step before them was completed
    overlap_breaks: int = 0  # times the pipeline broke: a step completed before the next was planned
    overlap_wasted_tokens: int = 0  # tokens computed for sequences that had ended (in decode_tokens)
