"""What streaming GRPO (:mod:`nopad.training.streaming`) hands the trainer and counts: a finished group
(a prompt's completions, or its tool episodes) and the stream's counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nopad.inference.episode_types import Episode
from nopad.inference.outputs import RequestOutput


@dataclass
class FinishedGroup:
    """A group whose completions (or tool episodes) have all ended: what the trainer takes."""

    index: int  # admission order on this rank: which prompt, and which step's seed, it was
    output: RequestOutput | None  # a plain group's completions
    finished_at: int  # the generator step that ended its last completion
    episodes: list[Episode] | None = None  # a tool-episode group's, by branch

    @property
    def samples(self) -> list:
        """Its completions or episodes: each has the ``policy_versions`` of its sampled tokens."""
        return self.output.outputs if self.episodes is None else self.episodes

    @property
    def oldest_version(self) -> int | None:
        versions = [min(c.policy_versions) for c in self.samples if c.policy_versions]
        return min(versions) if versions else None

    @property
    def num_tokens(self) -> int:
        """Its sampled tokens (an episode's tool tokens are not sampled)."""
        return sum(len(c.policy_versions) for c in self.samples)


@dataclass
class StreamStats:
    """Counters since construction: what was dropped, how full the generator ran."""

    admitted_groups: int = 0
    trained_groups: int = 0
    dropped_groups: int = 0
    dropped_tokens: int = 0
    decode_steps: int = 0  # generator steps run
    decode_rows: int = 0  # sequences in those steps, summed (occupancy = decode_rows / decode_steps)
    staleness: Counter = field(default_factory=Counter)  # trained tokens by age in optimizer steps
