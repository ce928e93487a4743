"""The records of multi-turn tool episodes (:mod:`nopad.inference.episodes`): the limits an episode
runs under, its turns, and the finished :class:`Episode` a trainer reads, with the one check of its
reward. Kept apart from the runner so that the records read without the bookkeeping."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

from nopad.inference.tools import ToolCall


@dataclass
class EpisodeLimits:
    """``max_turns``: model turns per episode (a tool call in the last one is not run);
    ``max_tokens``: tokens after the prompt, the model's and the tools' (TRL's
    ``max_completion_length``); ``tool_timeout`` in seconds per round of calls;
    ``max_tool_result_chars``: a longer result is replaced by an error message;
    ``tool_workers``: threads running synchronous tools; ``tool_grace``: seconds the step after a
    round of calls waits for it before decoding on without it. With a grace, a round that returns
    within it always resumes at the step after its call, whatever the threads' timing: which step
    an episode resumes at is then decided by the decode steps alone (streaming GRPO needs that; the
    tokens of a run that never changes its weights do not depend on it)."""

    max_turns: int = 8
    max_tokens: int = 1024
    tool_timeout: float = 30.0
    max_tool_result_chars: int = 16384
    tool_workers: int = 8
    tool_grace: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens", "max_tool_result_chars", "tool_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EpisodeLimits.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.tool_timeout, (int, float)) or not self.tool_timeout > 0:
            raise ValueError(f"EpisodeLimits.tool_timeout must be a number of seconds > 0, got {self.tool_timeout!r}")
        if (
            isinstance(self.tool_grace, bool)
            or not isinstance(self.tool_grace, (int, float))
            or not self.tool_grace >= 0
        ):
            raise ValueError(f"EpisodeLimits.tool_grace must be a number of seconds >= 0, got {self.tool_grace!r}")


@dataclass
class Turn:
    """One model turn: its tokens are ``completion_ids[start:end]``; the results of its
    ``tool_calls`` follow as ``completion_ids[end:tool_end]`` (``tool_end == end``: none). Calls
    of a turn that ended the episode (``max_turns``, no room for the result) keep ``result``
    None: they were not run."""

    start: int
    end: int
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_end: int | None = None
    malformed: str | None = None  # the parser's error when the turn held a malformed call

    def __post_init__(self) -> None:
        if self.tool_end is None:
            self.tool_end = self.end


@dataclass
class Episode:
    """A finished episode. ``finish_reason``: "stop" (a final answer, or a malformed tool call),
    "length" (a token limit), "max_turns", "cache_full" (alone it outgrew the KV cache; see
    ``error``) or "abort". ``branch`` orders the samples and forks of one prompt."""

    prompt_index: int
    branch: tuple[int, ...]
    prompt_token_ids: list[int]
    completion_ids: list[int]
    model_mask: list[int]  # 1: sampled by the model (trained on), 0: a tool's tokens
    logprobs: list[float]  # raw model log-prob of each token (0.0 at tool tokens)
    temperature_logprobs: list[float]  # under softmax(logits / temperature): what GRPO scores
    sampling_logprobs: list[float]  # under the processed distribution it was drawn from
    turns: list[Turn]
    finish_reason: str
    policy_versions: list[int] = field(default_factory=list)  # per model token (mask 1): the weights that drew it
    num_tool_calls: int = 0
    num_tool_errors: int = 0  # raised, timed out, unknown tool, garbage output
    num_malformed: int = 0
    reward: float | None = None
    environment: object | None = None
    error: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def finite_reward(reward_fn: Callable, episode: Episode, tokenizer=None) -> float:
    """The episode's reward as one finite float: a NaN would make every advantage of its group NaN,
    and a string or list would fail later with an error that names no function. A reward that
    raises is wrapped in an error naming the episode and its prompt (the traceback names neither)."""
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    ids = episode.prompt_token_ids
    text = " ".join(tokenizer.decode(ids).split()) if hasattr(tokenizer, "decode") else str(ids)
    where = (
        f"the episode of prompt {episode.prompt_index} (branch {episode.branch}, finish_reason "
        f"{episode.finish_reason!r}, prompt {text[:80] + ('...' if len(text) > 80 else '')!r})"
    )
    try:
        value = reward_fn(episode)
    except Exception as err:
        raise RuntimeError(
            f"episode reward {name} raised {type(err).__name__}: {err}, for {where}; fix the "
            "reward function (its traceback is above), e.g. return 0.0 where it cannot "
            "score"
        ) from err
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(
            f"episode reward {name} returned {value!r} for {where}; it must return one finite "
            "number (e.g. 0.0 where it cannot score)"
        )
    return float(value)
