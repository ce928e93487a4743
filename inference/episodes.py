"""Multi-turn episodes in the in-flight generator: a model turn ends at a tool call, at EOS or at a
limit; at a tool call the sequence pauses with its KV blocks pinned, its tools run off the decode
loop while the other sequences decode, and it resumes by prefilling only the tool result's tokens
(token-in/token-out: earlier turns are never re-tokenized).

:class:`Episode` (:mod:`nopad.inference.episode_types`) is the record a trainer reads.
:class:`EpisodeRunner` is the generator's bookkeeping for an open set of episode groups (a prompt
and its samples): groups are added while others run, and a group is finished when every one of
its episodes has ended (:meth:`nopad.inference.Generator.open_episodes`; ``run_episodes`` is one
such set, run to its end).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from nopad.inference.episode_types import Episode, EpisodeLimits, Turn, finite_reward
from nopad.inference.request import Request, Sequence, Status
from nopad.inference.scheduler import Scheduler
from nopad.inference.tools import ToolCall, ToolFormat, ToolRunner, public_methods, wait_all, wait_any

__all__ = ["Episode", "EpisodeLimits", "EpisodeRunner", "Turn"]

logger = logging.getLogger(__name__)


@dataclass
class _State:
    """What a live episode carries besides its sequence's tokens (copied on fork)."""

    prompt_index: int
    branch: tuple[int, ...]
    base_tools: dict[str, Callable]  # the caller's tools; an environment's methods are added
    environment: object | None
    turns: list[Turn] = field(default_factory=list)
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_malformed: int = 0
    tool_spans: list[tuple[int, int]] = field(default_factory=list)  # absolute token ranges of tool results
    error: str | None = None


@dataclass
class _Pending:
    seq: Sequence
    calls: list[ToolCall]
    futures: list
    deadline: float
    grace_until: float = 0.0  # the next step waits for the calls until then (EpisodeLimits.tool_grace)


@dataclass
class _Group:
    """A prompt's episodes: its samples' environments, how many still run, those that ended."""

    environments: list[object] | None
    live: int = 0
    episodes: list[Episode] = field(default_factory=list)


class EpisodeRunner:
    """Episode groups in flight: turn ends, pauses, tools, resumes, forks, and the groups whose
    episodes have all ended, in the order they ended. It is its sequences'
    :class:`~nopad.inference.request.SequenceHooks`: the scheduler's postprocess calls it at their events."""

    def __init__(
        self,
        scheduler: Scheduler,
        tool_format: ToolFormat,
        limits: EpisodeLimits,
        vocab_size: int,
        reward_fn: Callable[[Episode], float] | None = None,
        fork: Callable[[Episode], int] | None = None,
        max_num_seqs: int = 1,
    ):
        self.scheduler, self.format, self.limits = scheduler, tool_format, limits
        self.vocab_size, self.reward_fn, self.fork_fn, self.max_num_seqs = vocab_size, reward_fn, fork, max_num_seqs
        self.tools = ToolRunner(limits.tool_timeout, limits.max_tool_result_chars, limits.tool_workers)
        self.pending: list[_Pending] = []
        self.groups: dict[int, _Group] = {}  # in flight, by group (the episodes' prompt_index)
        self.finished: list[tuple[int, list[Episode]]] = []  # groups ended, not yet taken, in order
        self.live = 0
        self.tool_wait_s = 0.0  # time the decode loop sat idle because every episode waited on tools

    # ----------------------------------------------------------------- lifecycle
    def start(
        self, request: Request, group: int, tools: dict[str, Callable], environments: list[object] | None = None
    ) -> Sequence:
        """The first sequence of group ``group`` (its ``Episode.prompt_index``), with its tools and its
        samples' environments (reset)."""
        if group in self.groups:
            raise ValueError(f"episode group {group} is already in flight")
        seq = request.first_sequence(self)  # the scheduler's postprocess calls turn_ended, forked, ...
        self.groups[group] = _Group(environments, live=1)
        seq.episode = _State(group, (0,), tools, environments[0] if environments is not None else None)
        seq.max_generated = self.limits.max_tokens
        self.live += 1
        return seq

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """Give each new branch its own state: a prompt's samples get their own environments
        (:func:`nopad.inference.environments.reset_environments`), a later fork copies the parent's
        (deep copy: the branches' tools must not share state)."""
        state: _State = parent.episode
        first = parent.num_tokens == parent.num_prompt_tokens  # the samples of the prompt
        if not first:
            state.branch = state.branch + (0,)
        for child in children:
            new = copy.copy(state)
            new.turns = copy.deepcopy(state.turns)
            new.tool_spans = list(state.tool_spans)
            if first:
                new.branch = (child.index,)
                envs = self.groups[state.prompt_index].environments
                new.environment = envs[child.index] if envs is not None else None
            else:
                new.branch = state.branch[:-1] + (child.index,)
                new.environment = copy.deepcopy(state.environment)
            child.episode = new
            self.live += 1
            self.groups[state.prompt_index].live += 1

    # ----------------------------------------------------------------- a turn ends
    def turn_ended(self, seq: Sequence, reason: str) -> None:
        """Called when a sampled token ends the model's turn (stop token or string: "stop";
        a token limit: "length"). Pauses the episode at a tool call, else finishes it."""
        state: _State = seq.episode
        prompt_len = seq.num_prompt_tokens
        turn = Turn(seq.turn_start - prompt_len, seq.num_tokens - prompt_len)
        state.turns.append(turn)
        if reason != "stop":
            return self.finish(seq, reason)
        turn_ids = seq.token_ids[seq.turn_start :]
        name = f"the tool format {type(self.format).__name__}"
        try:
            calls = list(self.format.parse(turn_ids, seq.token_ids[: seq.turn_start]) or [])
        except ValueError as err:  # the format's "malformed call": the model's turn ends, not the batch
            turn.malformed = f"{type(err).__name__}: {err}"
            state.num_malformed += 1
            return self.finish(seq, "stop")
        except Exception as err:  # a bug in the format, not the model's output: say so, do not train on it
            raise RuntimeError(
                f"{name}'s parse() raised {type(err).__name__}: {err} (prompt {state.prompt_index}, turn "
                f"{len(state.turns)}); only a ValueError means a malformed call (the model's, kept in "
                "Turn.malformed), so this is a bug in parse(): fix it, or raise ValueError for a turn it "
                "cannot read"
            ) from err
        if not all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) for c in calls):
            raise TypeError(
                f"{name}'s parse() returned {calls!r}; it must return a list of "
                "nopad.inference.tools.ToolCall with dict arguments ([] for a final answer)"
            )
        if not calls:
            return self.finish(seq, "stop")
        turn.tool_calls = calls
        if len(state.turns) >= self.limits.max_turns:
            return self.finish(seq, "max_turns")
        self.scheduler.pause(seq)
        tools = (
            state.base_tools if state.environment is None else {**state.base_tools, **public_methods(state.environment)}
        )
        futures, deadline = self.tools.submit(calls, tools)
        grace = time.monotonic() + self.limits.tool_grace if self.limits.tool_grace else 0.0
        self.pending.append(_Pending(seq, calls, futures, deadline, grace))

    # ----------------------------------------------------------------- tools return
    def poll(self, block: bool) -> None:
        """Resume every episode whose tools have all returned (or timed out). ``block``: the
        decode loop has nothing to run, so wait for the first one instead of spinning."""
        if block and not self.pending:  # a paused episode nobody resumes: the loop would spin for ever
            raise RuntimeError(
                "every live sequence is paused but no episode waits on its tools (a bug): "
                "please report it with the episode setup"
            )
        if self.limits.tool_grace:  # calls that return within the grace resume at the next step, always
            now = time.monotonic()
            recent = [p for p in self.pending if now < p.grace_until]
            if recent:
                wait_all([f for p in recent for f in p.futures], max(p.grace_until for p in recent))
        ready, waiting = self._split()
        if block and not ready:
            start = time.perf_counter()
            wait_any([f for p in waiting for f in p.futures], min(p.deadline for p in waiting))
            self.tool_wait_s += time.perf_counter() - start
            ready, waiting = self._split()
        self.pending = waiting
        for p in ready:
            self._resume(p)

    def _split(self) -> tuple[list[_Pending], list[_Pending]]:
        """(ready, still waiting): each episode decided once, as a tool may finish or a deadline
        pass while the list is read; deciding twice left such an episode in neither, paused for ever."""
        now, ready, waiting = time.monotonic(), [], []
        for p in self.pending:
            done = now >= p.deadline or all(f is None or f.done() for f in p.futures)
            (ready if done else waiting).append(p)
        return ready, waiting

    def _resume(self, p: _Pending) -> None:
        seq, state = p.seq, p.seq.episode
        self.tools.collect(p.calls, p.futures)
        state.num_tool_calls += len(p.calls)
        state.num_tool_errors += sum(c.error for c in p.calls)
        messages = [{"role": "tool", "name": c.name, "content": c.result} for c in p.calls]
        try:
            tokens = list(self.format.render(messages, seq.token_ids[seq.turn_start :]))
        except Exception as err:  # noqa: BLE001 - the format is user code; end this episode, not the batch
            state.error = f"rendering the tool results failed: {type(err).__name__}: {err}"
            return self.finish(seq, "abort")
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            state.error = f"the tool format rendered {bad[0]!r}, not a token id in [0, {self.vocab_size})"
            return self.finish(seq, "abort")
        if seq.num_generated + len(tokens) >= seq.max_generated:
            return self.finish(seq, "length")  # no room for the result and one more model token
        if not self.scheduler.fits(seq.num_tokens + len(tokens)):
            return self.finish_out_of_memory(seq, seq.num_tokens + len(tokens))
        state.tool_spans.append((seq.num_tokens, seq.num_tokens + len(tokens)))
        state.turns[-1].tool_end = state.turns[-1].end + len(tokens)
        self.scheduler.resume(seq, tokens)
        seq.turn_start = seq.num_tokens
        if self.fork_fn is not None:  # a turn boundary: the branches share every block so far
            branches = self.fork_fn(self._episode(seq, None))
            if isinstance(branches, bool) or not isinstance(branches, int) or not 1 <= branches <= self.max_num_seqs:
                raise ValueError(
                    f"fork() returned {branches!r}; it must be an int in [1, max_num_seqs={self.max_num_seqs}]"
                )
            seq.fork_count = branches

    # ----------------------------------------------------------------- ending
    def stopped(self, seq: Sequence) -> None:
        """The scheduler stopped ``seq``: alone, it outgrew the KV cache."""
        self.finish_out_of_memory(seq, seq.num_tokens)

    def finish_out_of_memory(self, seq: Sequence, num_tokens: int) -> None:
        blocks, bs = self.scheduler.allocator.num_blocks, self.scheduler.block_size
        seq.episode.error = (
            f"the episode needs {num_tokens} tokens of KV cache but the whole cache holds {blocks * bs} "
            f"({blocks} blocks of {bs}); give the Generator more kv_memory_bytes/num_blocks or lower "
            "EpisodeLimits.max_tokens"
        )
        logger.warning("episode of prompt %d stopped: %s", seq.episode.prompt_index, seq.episode.error)
        self.finish(seq, "cache_full")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, reason)
        episode = self._episode(seq, reason)
        if self.reward_fn is not None and reason != "abort":
            episode.reward = finite_reward(self.reward_fn, episode, self.scheduler.tokenizer)
        group = self.groups[episode.prompt_index]
        group.episodes.append(episode)
        group.live -= 1
        self.live -= 1
        if not group.live:  # its last episode ended: the group is finished
            del self.groups[episode.prompt_index]
            self.finished.append((episode.prompt_index, sorted(group.episodes, key=lambda e: e.branch)))

    def take_finished(self) -> list[tuple[int, list[Episode]]]:
        """``(group, its episodes by branch)`` of every group finished since the last call, in the
        order they finished."""
        finished, self.finished = self.finished, []
        return finished

    def sequences(self, group: int | None = None) -> list[Sequence]:
        """The live sequences of ``group`` (default: of every group), in the scheduler's order."""
        return [
            seq
            for seq in (*self.scheduler.running, *self.scheduler.waiting, *self.scheduler.paused)
            if seq.hooks is self and (group is None or seq.episode.prompt_index == group)
        ]

    def abort(self, group: int | None = None) -> None:
        """Stop the live episodes of ``group`` (default: every one, after an error): free their
        blocks, drop their tools. Their group is finished with them (``finish_reason`` "abort")."""
        seqs = self.sequences(group)
        stopped = [p for p in self.pending if p.seq in seqs]
        for p in stopped:
            for f in p.futures:
                if f is not None:
                    f.cancel()
        self.pending = [p for p in self.pending if p not in stopped]
        for seq in seqs:
            self.finish(seq, "abort")

    def close(self) -> None:
        self.tools.close()

    def _episode(self, seq: Sequence, reason: str | None) -> Episode:
        state: _State = seq.episode
        prompt_len = seq.num_prompt_tokens
        ids = seq.token_ids[prompt_len:]
        mask = [1] * len(ids)
        for start, end in state.tool_spans:
            mask[start - prompt_len : end - prompt_len] = [0] * (end - start)
        lists = []
        for sampled in (seq.logprobs, seq.temperature_logprobs, seq.sampling_logprobs):
            it = iter(sampled)
            lists.append([next(it) if m else 0.0 for m in mask])
        return Episode(
            prompt_index=state.prompt_index,
            branch=state.branch,
            prompt_token_ids=seq.token_ids[:prompt_len],
            completion_ids=ids,
            model_mask=mask,
            logprobs=lists[0],
            temperature_logprobs=lists[1],
            sampling_logprobs=lists[2],
            policy_versions=list(seq.policy_versions),
            turns=copy.deepcopy(state.turns),
            finish_reason=reason,
            num_tool_calls=state.num_tool_calls,
            num_tool_errors=state.num_tool_errors,
            num_malformed=state.num_malformed,
            environment=state.environment,
            error=state.error,
        )
