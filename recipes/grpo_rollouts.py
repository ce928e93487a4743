"""What the GRPO recipe's rollouts are made of, from its config: the sampling parameters of a step,
the generator, the tool episodes of a tool task or ``task.environment``, and streaming mode's
source of groups (:mod:`nopad.training.streaming`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nopad.recipes.env_tasks import environment_format, load_environment
from nopad.recipes.grpo_config import GRPORecipeConfig
from nopad.recipes.tasks import tool_task

if TYPE_CHECKING:  # torch and training/ are imported where they run, so --help answers without them
    from nopad.training.grpo_step import ToolEpisodes


def sampling_params(cfg: GRPORecipeConfig, step: int):
    from nopad.inference import SamplingParams

    ro = cfg.rollout
    task = tool_task(cfg.task.name, cfg.task.prompts)
    return SamplingParams(
        n=ro.num_generations,
        max_tokens=ro.max_tokens,
        temperature=ro.temperature,
        top_p=ro.top_p,
        seed=ro.seed * 1_000_003 + step,
        stop=task.stop if task else None,
    )


def make_generator(model, cfg: GRPORecipeConfig, tokenizer=None):
    """The rollout generator; ``tokenizer`` for tool tasks, whose calls end at a stop string."""
    from nopad.inference import Generator

    g = cfg.generator
    return Generator(
        model,
        tokenizer,
        block_size=g.block_size,
        num_blocks=g.num_blocks,
        max_num_seqs=g.max_num_seqs,
        max_num_batched_tokens=g.max_num_batched_tokens,
    )


class StepRollouts:
    """Each step's rollouts and training: the synchronous step on this rank's prompts of the step, or
    (``rollout.mode=streaming``) the next groups of :class:`nopad.training.streaming.StreamingRollouts`.
    Group ``i`` of this rank is the example the synchronous step ``i // prompts_per_step`` would take,
    sampled with that step's seed, so both modes draw the same prompts in the same order."""

    def __init__(
        self,
        cfg: GRPORecipeConfig,
        generator,
        examples: list[dict],
        prompt_ids: list[list[int]],
        order: list[int],
        rank: int,
        world: int,
        episodes: ToolEpisodes | None,
        progress: bool,
    ):
        from nopad.training.streaming import StreamingRollouts

        self.cfg, self.generator, self.examples, self.prompt_ids = cfg, generator, examples, prompt_ids
        self.order, self.rank, self.world = order, rank, world
        self.episodes, self.progress = episodes, progress
        ro = cfg.rollout
        self.stream = None
        if ro.mode == "streaming":
            self.stream = StreamingRollouts(
                generator,
                self.group,
                groups_per_step=ro.prompts_per_step,
                max_staleness=ro.max_staleness,
                stale_kv=ro.stale_kv,
                total_groups=cfg.train.steps * ro.prompts_per_step,
                episodes=None if episodes is None else open_episodes(generator, episodes),
            )

    def group(self, i: int) -> tuple:
        """Streaming's ``source``: group ``i``'s prompt ids and sampling parameters (and, for an
        environment, its example as the keywords of its ``reset``)."""
        index, ro = self.pick(i), self.cfg.rollout
        params = sampling_params(self.cfg, i // ro.prompts_per_step)
        if self.episodes is not None and self.episodes.environment_factory is not None:
            return self.prompt_ids[index], params, {"reset_kwargs": self.examples[index]}
        return self.prompt_ids[index], params

    def pick(self, group: int) -> int:
        """The example index of this rank's ``group``-th group."""
        per_step = self.cfg.rollout.prompts_per_step
        step, j = divmod(group, per_step)
        return self.order[((step * self.world + self.rank) * per_step + j) % len(self.order)]

    def train_step(self, stepper, step: int, reward_fn, tokenizer, loss, ref_model=None) -> dict:
        """One GRPO step's rollouts, rewards and optimizer step(s); returns its metrics."""
        from nopad.training.grpo_step import grpo_step
        from nopad.training.streaming import streaming_step

        cfg = self.cfg
        if self.stream is not None:
            return streaming_step(
                stepper,
                self.stream,
                lambda g: (self.examples[self.pick(g)], self.prompt_ids[self.pick(g)]),
                reward_fn,
                tokenizer,
                loss,
                step=step,
                temperature=cfg.rollout.temperature,
                ref_model=ref_model,
                episode_reward=self.episodes is not None and self.episodes.episode_reward,
            )
        picks = [self.pick(step * cfg.rollout.prompts_per_step + j) for j in range(cfg.rollout.prompts_per_step)]
        return grpo_step(
            stepper,
            self.generator,
            [self.examples[i] for i in picks],
            [self.prompt_ids[i] for i in picks],
            reward_fn,
            tokenizer,
            sampling_params(cfg, step),
            loss,
            step=step,
            rollout_mode=cfg.generator.sharded_rollout,
            ref_model=ref_model,
            use_tqdm=self.progress,
            episodes=self.episodes,
        )

    def close(self) -> None:
        """Abort what streaming left in flight and free the generator's KV cache."""
        if self.stream is not None:
            self.stream.close()
        self.generator.release()


def open_episodes(generator, episodes: ToolEpisodes):
    """Streaming's episode session on ``generator``: the task's tools, format, limits and environments."""
    from nopad.training.grpo_episodes import check_unsharded

    check_unsharded(generator.model)
    return generator.open_episodes(
        episodes.tools,
        limits=episodes.limits,
        tool_format=episodes.tool_format,
        environment_factory=episodes.environment_factory,
    )


def environment_tools(cfg: GRPORecipeConfig, tokenizer):
    """The chat template's tool format with ``task.environment``'s tools; None without one."""
    spec = cfg.task.environment
    return None if spec is None else environment_format(tokenizer, load_environment(spec), spec)


def tool_episodes(cfg: GRPORecipeConfig, tokenizer) -> ToolEpisodes | None:
    """The tool task's tools, call format and episode limits, and ``task.environment`` (one per
    episode, rewarded as a whole); None for a single-turn task."""
    from nopad.inference.episodes import EpisodeLimits
    from nopad.training.grpo_step import ToolEpisodes

    task, spec = tool_task(cfg.task.name, cfg.task.prompts), cfg.task.environment
    if task is None and spec is None:
        return None
    ro = cfg.rollout
    grace = ro.tool_grace if ro.mode == "streaming" else 0.0  # only streaming's steps depend on when tools return
    limits = EpisodeLimits(
        max_turns=ro.max_turns, max_tokens=ro.max_tokens, tool_timeout=ro.tool_timeout, tool_grace=grace
    )
    tool_format = task.tool_format(tokenizer) if task is not None else environment_tools(cfg, tokenizer)
    return ToolEpisodes(
        task.tools if task is not None else {},
        tool_format,
        limits,
        environment_factory=load_environment(spec) if spec is not None else None,
        episode_reward=spec is not None,
    )
