"""The generator's multi-turn entry points: :meth:`EpisodeGeneration.open_episodes`, an open set of tool
episodes (:mod:`nopad.inference.episodes`) that the generator's steps run while groups are added and
taken, and :meth:`EpisodeGeneration.run_episodes`, one such set run to its end. A base of
:class:`nopad.inference.Generator`, which provides the loop (``run``, ``step``), the requests and the
scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from nopad.inference.episode_setup import episode_setup, named_tools
from nopad.inference.episodes import Episode, EpisodeLimits, EpisodeRunner
from nopad.inference.request import Request, Sequence
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.sharded import refuse_plain_generation
from nopad.inference.tools import ToolFormat


class EpisodeSession:
    """Tool-episode groups in flight on a generator, added one at a time. :meth:`add` queues a group (a
    prompt and its ``n`` samples) without running anything; the generator's ``step()`` runs every group
    in flight (paused episodes keep their KV blocks across steps, and across ``update_weights``);
    :meth:`take_finished` returns the groups whose episodes have all ended, in the order they ended.
    Streaming GRPO admits groups into one as slots free up. Made by ``Generator.open_episodes``."""

    def __init__(
        self,
        generator,
        tools: dict[str, Callable],
        tool_format: ToolFormat,
        limits: EpisodeLimits,
        environment_factory: Callable | None = None,
        reward_fn=None,
        fork=None,
    ):
        self.generator, self.tools, self.environment_factory = generator, tools, environment_factory
        self.runner = EpisodeRunner(
            generator.scheduler,
            tool_format,
            limits,
            generator.vocab_size,
            reward_fn,
            fork,
            generator.scheduler.max_num_seqs,
        )
        self.next_group = 0
        generator._episodes = self.runner  # has_unfinished() and abort_all() see its episodes

    def add(
        self,
        prompt,
        sampling_params: SamplingParams | None = None,
        *,
        tools: Mapping[str, Callable] | None = None,
        reset_kwargs: Mapping | None = None,
    ) -> int:
        """Queue the episodes of one prompt (``n`` from the sampling parameters); returns their group,
        the ``prompt_index`` of its Episodes. ``tools`` (default: the session's) and ``reset_kwargs``
        (its environments' ``reset(**kwargs)``) are this group's, as ``prompt_tools`` and
        ``reset_kwargs`` of ``run_episodes``. Bad input raises here, before anything is queued."""
        runner = self.runner
        setup = episode_setup(
            [prompt],
            self.tools,
            sampling_params,
            self.generator.tokenizer,
            limits=runner.limits,
            tool_format=runner.format,
            environment_factory=self.environment_factory,
            prompt_tools=None if tools is None else [tools],
            reset_kwargs=None if reset_kwargs is None else [reset_kwargs],
        )
        generator = self.generator
        request = generator.request_builder.build(setup.prompts[0], sampling_params, None, generator._plain.in_flight)
        envs = setup.environments[0] if setup.environments is not None else None
        return self.start(request, setup.tools[0], envs)

    def start(self, request: Request, tools: dict[str, Callable], environments: list | None = None) -> int:
        """Queue a checked request's episodes (:meth:`add` without the checks); returns its group."""
        group, self.next_group = self.next_group, self.next_group + 1
        self.generator._enqueue(request, lambda r: self.runner.start(r, group, tools, environments))
        return group

    def take_finished(self) -> list[tuple[int, list[Episode]]]:
        """``(group, its episodes by branch)`` of every group finished since the last call, in order."""
        return self.runner.take_finished()

    def sequences(self, group: int) -> list[Sequence]:
        """The live sequences of ``group`` (their tokens, log-probs and policy versions so far)."""
        return self.runner.sequences(group)

    def abort(self, group: int) -> None:
        """Stop ``group``'s episodes; it finishes (``finish_reason`` "abort") at once."""
        self.runner.abort(group)

    @property
    def live(self) -> int:
        return self.runner.live

    def close(self) -> None:
        """Abort what is still in flight, stop the tool threads and detach from the generator."""
        if self.runner.live:
            self.runner.abort()
        self.runner.close()
        if self.generator._episodes is self.runner:
            self.generator._episodes = None
        self.generator.last_episode_stats = {"tool_wait_s": self.runner.tool_wait_s}


class EpisodeGeneration:
    """:meth:`open_episodes` and :meth:`run_episodes` of :class:`nopad.inference.Generator`."""

    def open_episodes(
        self,
        tools: Seq[Callable] | Mapping[str, Callable] = (),
        *,
        limits: EpisodeLimits | None = None,
        tool_format: ToolFormat | None = None,
        environment_factory: Callable | None = None,
        reward_fn: Callable[[Episode], float] | None = None,
        fork: Callable[[Episode], int] | None = None,
    ) -> EpisodeSession:
        """An :class:`EpisodeSession`: episode groups added one at a time (``session.add``) and run by
        this generator's ``step()`` until ``session.close()``. The arguments are ``run_episodes``'."""
        refuse_plain_generation(self.model)
        if self.has_unfinished():
            raise RuntimeError("open_episodes() while requests are in flight; finish or abort them first")
        setup = episode_setup(  # no prompt yet: the limits and the tool format, checked and resolved
            [],
            tools,
            None,
            self.tokenizer,
            limits=limits,
            tool_format=tool_format,
            environment_factory=None,
            prompt_tools=None,
        )
        return EpisodeSession(
            self, named_tools(tools), setup.tool_format, setup.limits, environment_factory, reward_fn, fork
        )

    def run_episodes(
        self,
        prompts,
        tools: Seq[Callable] | Mapping[str, Callable] = (),
        sampling_params: SamplingParams | None = None,
        *,
        limits: EpisodeLimits | None = None,
        tool_format: ToolFormat | None = None,
        environment_factory: Callable | None = None,
        reward_fn: Callable[[Episode], float] | None = None,
        fork: Callable[[Episode], int] | None = None,
        prompt_tools: Seq[Mapping[str, Callable]] | None = None,
        reset_kwargs: Seq[Mapping] | None = None,
    ) -> list[Episode]:
        """Run multi-turn tool episodes for every prompt (``n`` per prompt from the sampling
        parameters); returns them by prompt, then branch.

        ``prompts``: token ids, strings, or chat messages (rendered with the tools by the chat
        template). ``tools``: functions (sync or ``async def``) the model may call by name.
        ``tool_format``: how calls are parsed and results rendered; default the tokenizer's
        :class:`~nopad.inference.tools.ChatTemplateTools`. ``environment_factory``: one environment per
        episode, its public methods added as tools (forks deep-copy it), reset with ``reset_kwargs``;
        ``reward_fn(episode)`` sets ``Episode.reward``. ``fork(episode)`` is asked at every turn boundary
        (a tool result appended) how many continuations to run; they share every block so far.
        ``sampling_params.max_tokens`` caps one model turn, ``limits`` the whole episode
        (:class:`~nopad.inference.episodes.EpisodeLimits`). ``prompt_tools``: one ``{name: function}``
        per prompt instead of ``tools`` (e.g. bound to that prompt's own environment, as TRL's trainer
        builds them). ``reset_kwargs``: each prompt's ``reset(**example)`` (default ``prompt=``)."""
        refuse_plain_generation(self.model)
        if self.has_unfinished():
            raise RuntimeError("run_episodes() while requests are in flight; finish or abort them first")
        setup = episode_setup(  # every prompt checked before any is queued
            prompts,
            tools,
            sampling_params,
            self.tokenizer,
            limits=limits,
            tool_format=tool_format,
            environment_factory=environment_factory,
            prompt_tools=prompt_tools,
            reset_kwargs=reset_kwargs,
        )
        requests = self.make_requests(setup.prompts, sampling_params)
        session = EpisodeSession(self, {}, setup.tool_format, setup.limits, None, reward_fn, fork)
        try:
            for i, request in enumerate(requests):
                session.start(request, setup.tools[i], setup.environments[i] if setup.environments else None)
            self.run([])  # the one generate loop, here over the episodes just queued
        finally:
            session.close()
        done = [episode for _, group in session.take_finished() for episode in group]
        return sorted(done, key=lambda e: (e.prompt_index, e.branch))
