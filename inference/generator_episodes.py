"""The generator's multi-turn entry point, :meth:`EpisodeGeneration.run_episodes`: tool episodes
(:mod:`nopad.inference.episodes`) queued and run through the generator's one loop. A base of
:class:`nopad.inference.Generator`, which provides the loop (``run``), the requests and the scheduler."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq

from nopad.inference.episode_setup import episode_setup
from nopad.inference.episodes import Episode, EpisodeLimits, EpisodeRunner
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.sharded import refuse_plain_generation
from nopad.inference.tools import ToolFormat


class EpisodeGeneration:
    """:meth:`run_episodes` of :class:`nopad.inference.Generator`."""

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
        setup = episode_setup(
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
        runner = EpisodeRunner(
            self.scheduler,
            setup.tool_format,
            setup.limits,
            self.vocab_size,
            setup.environments,
            reward_fn,
            fork,
            self.scheduler.max_num_seqs,
        )
        self._episodes = runner
        try:
            for i, request in enumerate(requests):
                self._enqueue(request, lambda r, i=i: runner.start(r, i, setup.tools[i]))
            self.run([])  # the one generate loop, here over the episodes just queued
        finally:
            runner.close()
            self._episodes = None
            self.last_episode_stats = {"tool_wait_s": runner.tool_wait_s}
        return runner.results()
