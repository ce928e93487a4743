"""The multi-turn rollouts of one GRPO step: tool episodes on the live policy
(:meth:`nopad.inference.Generator.run_episodes`), each episode's :class:`~nopad.training.grpo.Rollout`,
and what its reward reads: the last model turn's tokens (a reward of the answer's text), or the
whole :class:`~nopad.inference.episodes.Episode` (an episode reward, e.g. one that reads the
episode's environment, as TRL's reward functions read ``environments``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nopad.inference.episodes import Episode, EpisodeLimits
from nopad.inference.tools import ToolFormat
from nopad.training.grpo import Rollout


@dataclass
class ToolEpisodes:
    """Multi-turn rollouts: the tools the model may call, how calls look in tokens (None: the chat
    template's) and the episode limits. ``environment_factory``: one environment per episode, its
    public methods added to the tools and reset with the example's fields (TRL's
    ``reset(**example)``). ``episode_reward``: the reward is called with the whole Episode
    (``fn(episode, example)``) instead of the last model turn's text."""

    tools: Mapping[str, Callable]
    tool_format: ToolFormat | None = None
    limits: EpisodeLimits | None = None
    environment_factory: Callable | None = None
    episode_reward: bool = False


def run_episodes(
    generator,
    model,
    prompt_ids: Sequence[list[int]],
    params,
    episodes: ToolEpisodes,
    logprobs: str,
    examples: Sequence[Mapping] = (),
) -> tuple[list[list[tuple]], dict]:
    """Per prompt, per sample: (what the reward reads: the last model turn's token ids, or the
    Episode itself for an episode reward; its :class:`Rollout`), and the rollout's tool metrics.
    ``examples`` (one per prompt) are the keywords of each environment's ``reset``."""
    check_unsharded(model)
    factory = episodes.environment_factory
    done = generator.run_episodes(
        list(prompt_ids),
        episodes.tools,
        params,
        limits=episodes.limits,
        tool_format=episodes.tool_format,
        environment_factory=factory,
        reset_kwargs=list(examples) if factory is not None else None,
    )
    samples: list[list[tuple]] = [[] for _ in prompt_ids]
    for ep in done:
        samples[ep.prompt_index].append(episode_sample(ep, episodes.episode_reward, logprobs))
    return samples, {**tool_metrics(done), "tool_wait_s": float(generator.last_episode_stats.get("tool_wait_s", 0.0))}


def check_unsharded(model) -> None:
    """Tool episodes run on the whole policy: refuse sharded weights with one clear line."""
    from nopad.inference.sharded import sharded_weights

    if sharded_weights(model) is not None:
        raise ValueError(
            "tool episodes run on an unsharded policy; FSDP2-sharded GRPO takes single-turn "
            "tasks only (task.name without tools, no task.environment)"
        )


def episode_sample(episode: Episode, episode_reward: bool, logprobs: str) -> tuple:
    """(what the reward reads: the Episode itself for an episode reward, else the last model turn's
    token ids; the episode's :class:`Rollout`, tool tokens masked from the loss)."""
    read = episode if episode_reward else last_turn(episode)
    return read, Rollout.from_episode(episode, logprobs)


def tool_metrics(done: Sequence[Episode]) -> dict:
    """Tool calls per episode, the share of calls that failed, model turns per episode."""
    calls = sum(ep.num_tool_calls for ep in done)
    return {
        "tool_calls_per_episode": calls / max(len(done), 1),
        "tool_failure_rate": sum(ep.num_tool_errors for ep in done) / max(calls, 1),
        "tool_turns_mean": sum(ep.num_turns for ep in done) / max(len(done), 1),
    }


def last_turn(episode: Episode) -> list[int]:
    """The token ids of the episode's last model turn: the answer a text reward reads."""
    last = episode.turns[-1] if episode.turns else None
    return episode.completion_ids[last.start : last.end] if last is not None else []
