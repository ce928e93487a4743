"""Streaming GRPO: the generator keeps running across optimizer steps, so a step never waits for
its slowest rollout.

A synchronous step generates every completion of its prompts, then trains; the long tail decodes a
nearly empty batch while the trainer waits. Here the generator runs in the trainer's process on
the trainer's parameters (no weight copy), groups (a prompt and its ``n`` samples) are admitted as
slots free up, and an optimizer step takes the first ``groups_per_step`` groups to finish. Every
sampled token carries the policy version (optimizer steps so far) whose weights drew it and its
behaviour log-prob, recorded as it was sampled; the loss reads both (:mod:`nopad.training.grpo_step`).

What decides a step is the generator's own step count, never the wall clock: groups are ordered
by the decode step that finished them, then by admission, so a seeded run repeats exactly.

Tool episodes stream too (``episodes``: an :class:`~nopad.inference.generator_episodes.EpisodeSession`):
a group is a prompt's episodes, finished when all of them have ended; an episode paused on its tools
keeps its KV blocks across optimizer steps (its tool runs while the trainer trains) and resumes under
the new weights, on its old KV (``stale_kv=keep``) or re-prefilled (``recompute``). Which step an
episode resumes at is the decode steps' alone when its tools return within
``EpisodeLimits.tool_grace``; a tool slower than that resumes when it returns, so with tools of real
latency which groups form a step depends on timing.

``max_staleness`` has TRL ``AsyncGRPOConfig``'s meaning: a group whose oldest token is more than that
many optimizer steps old when it would be trained is dropped (and counted). The admission window
is ``(max_staleness + 1) x groups_per_step`` groups ahead of the trainer, so ``max_staleness=0``
admits exactly one step's groups and finishes them all: the synchronous step, bitwise.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from nopad.inference.generator import Generator
from nopad.inference.generator_episodes import EpisodeSession
from nopad.inference.in_flight import restore_requests, save_requests
from nopad.inference.outputs import RequestOutput
from nopad.inference.sharded import gathered_weights, sharded_weights
from nopad.inference.weight_updates import STALE_KV
from nopad.packing.distributed import world_size
from nopad.training.streaming_records import FinishedGroup, StreamStats

logger = logging.getLogger(__name__)

# group index -> (prompt ids, params), or (prompt ids, params, keywords of EpisodeSession.add) for episodes
GroupSource = Callable[[int], tuple]


class StreamingRollouts:
    """Groups for streaming GRPO steps from a generator that never drains between them.

    ``source(i)``: the prompt ids and sampling parameters of the ``i``-th group this rank admits
    (the recipe's prompt order and per-step seed). ``groups_per_step``: the groups an optimizer step
    takes (``rollout.prompts_per_step``). ``max_staleness``: see the module. ``stale_kv``: what the
    KV cache written by older weights becomes when the weights change
    (:meth:`nopad.inference.Generator.update_weights`). ``total_groups``: how many groups the run
    will train on; none is admitted beyond what that needs (dropped groups are replaced).
    ``episodes``: groups are tool episodes run in this session (``generator.open_episodes(...)``),
    ``source(i)`` may add the keywords of its ``add`` (e.g. ``reset_kwargs``); closed with the stream."""

    def __init__(
        self,
        generator: Generator,
        source: GroupSource,
        *,
        groups_per_step: int,
        max_staleness: int,
        stale_kv: str = "keep",
        total_groups: int | None = None,
        episodes: EpisodeSession | None = None,
    ):
        check_streaming(max_staleness, stale_kv)
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.generator, self.source = generator, source
        self.groups_per_step, self.max_staleness, self.stale_kv = groups_per_step, max_staleness, stale_kv
        self.total_groups, self.episodes = total_groups, episodes
        self.stats = StreamStats()
        self._next = 0  # the next group index to admit
        self._in_flight: dict[str | int, int] = {}  # request id (episodes: session group) -> group index
        self._ready: list[FinishedGroup] = []  # finished, in (finished_at, index) order
        self._steps = 0

    @property
    def policy_version(self) -> int:
        return self.generator.policy_version

    def next_groups(self) -> list[FinishedGroup]:
        """Run the generator until ``groups_per_step`` groups young enough to train on have finished;
        return them in admission order (the order the synchronous step trains its prompts in).
        On weights sharded over several ranks (ZeRO-3, FSDP2) it runs inside
        :func:`nopad.inference.sharded.gathered_weights`, as :func:`streaming_step` calls it."""
        generator = self.generator
        _check_gathered(generator.model)
        # staleness only grows at a weight update, and weights_updated() aborts in-flight groups it made
        # too old: a group finishing below is young enough, so the finished ones are checked once, here
        self._drop_stale()
        with generator.live.attention():  # switched once for the burst of steps, restored for training
            while len(self._ready) < self.groups_per_step:
                self._admit()
                if not generator.has_unfinished():
                    raise RuntimeError(
                        f"streaming rollouts ran out of groups: {len(self._ready)} finished of "
                        f"the {self.groups_per_step} a step takes and none in flight "
                        f"(total_groups={self.total_groups}); this is a bug"
                    )
                self._step()
        taken, self._ready = self._ready[: self.groups_per_step], self._ready[self.groups_per_step :]
        now = self.policy_version
        for group in taken:
            for completion in group.samples:
                self.stats.staleness.update(now - v for v in completion.policy_versions)
        self.stats.trained_groups += len(taken)
        return sorted(taken, key=lambda g: g.index)

    def weights_updated(self, steps: int = 1) -> None:
        """The trainer took ``steps`` optimizer steps on the generator's parameters. A group in flight
        whose oldest token is now too old to be trained on is aborted at once (its tokens counted as
        dropped): its staleness can only grow, and decoding it on would be wasted work."""
        self.generator.update_weights(self.stale_kv, steps)
        self._collect(self.generator.take_finished())  # groups the overlapped step in flight finished
        now = self.policy_version
        for key, index in list(self._in_flight.items()):
            seqs = self._sequences(key)
            versions = [seq.policy_versions[0] for seq in seqs if seq.policy_versions]
            if versions and now - min(versions) > self.max_staleness:
                tokens = sum(len(seq.policy_versions) for seq in seqs)
                self._abort(key)  # its "abort" output comes from the next step: ignored
                del self._in_flight[key]
                self.stats.dropped_groups += 1
                self.stats.dropped_tokens += tokens
                logger.debug(
                    "aborted group %d: its oldest token is %d steps old (max_staleness=%d)",
                    index,
                    now - min(versions),
                    self.max_staleness,
                )

    def close(self) -> None:
        """Abort what is still in flight (the run is over, or failed) and free the KV cache."""
        if self.episodes is not None:
            self.episodes.close()
        self.generator.abort_all()
        self._in_flight.clear()
        self.generator.release()

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the stream (picklable): the groups in flight (their tokens,
        log-probs and versions so far), the finished ones not yet trained, the counters and the
        policy version. With ``stale_kv=recompute`` a run resumed from it continues bitwise."""
        self._refuse_episode_checkpoint()
        return {
            "next": self._next,
            "steps": self._steps,
            "stats": self.snapshot(),
            "ready": list(self._ready),
            "in_flight": dict(self._in_flight),
            "policy_version": self.policy_version,
            "requests": save_requests(self.generator, list(self._in_flight)),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` on a fresh generator: every sequence in flight re-prefills
        its prompt and tokens with the current weights before its next token."""
        self._refuse_episode_checkpoint()
        if self.stale_kv == "keep" and state["in_flight"]:
            logger.warning(
                "resuming %d streaming groups in flight: their KV cache is recomputed with the "
                "resumed weights (stale_kv=keep kept the older weights' KV; with "
                "stale_kv=recompute a resumed run equals the uninterrupted one exactly)",
                len(state["in_flight"]),
            )
        restore_requests(self.generator, state["requests"])
        self.generator.versions.version = state["policy_version"]
        self._next, self._steps, self.stats = state["next"], state["steps"], state["stats"]
        self._ready, self._in_flight = list(state["ready"]), dict(state["in_flight"])

    def metrics(self, window: StreamStats | None = None) -> dict:
        """Occupancy, drops and staleness since construction (or since ``window``, a copy taken earlier)."""
        s, w = self.stats, window or StreamStats()
        steps = s.decode_steps - w.decode_steps
        ages = s.staleness - w.staleness
        tokens = sum(ages.values())
        return {
            "policy_version": self.policy_version,
            "decode_rows_mean": (s.decode_rows - w.decode_rows) / max(steps, 1),
            "dropped_groups": s.dropped_groups - w.dropped_groups,
            "dropped_tokens": s.dropped_tokens - w.dropped_tokens,
            "staleness_mean": sum(a * n for a, n in ages.items()) / max(tokens, 1),
            "staleness_max": max(ages, default=0),
        }

    def snapshot(self) -> StreamStats:
        s = self.stats
        return StreamStats(
            s.admitted_groups,
            s.trained_groups,
            s.dropped_groups,
            s.dropped_tokens,
            s.decode_steps,
            s.decode_rows,
            Counter(s.staleness),
        )

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        """Admit whole groups: always up to this step's own, and beyond it (up to the staleness
        window) only while the generator has free sequence slots, so it stays full without
        queueing work that would age in the queue."""
        generator, scheduler = self.generator, self.generator.scheduler
        window = (self.max_staleness + 1) * self.groups_per_step
        while self.total_groups is None or self._next - self.stats.dropped_groups < self.total_groups:
            ahead = len(self._in_flight) + len(self._ready)
            if ahead >= window:
                return
            prompt, params, *more = self.source(self._next)
            if ahead >= self.groups_per_step:
                live = sum(s.fork_count for s in (*scheduler.running, *scheduler.waiting))
                if live + params.n > scheduler.max_num_seqs:
                    return
            if self.episodes is not None:
                key = self.episodes.add(prompt, params, **(more[0] if more else {}))
            else:
                key = generator.add_request(prompt, params, request_id=f"group-{self._next}")
            self._in_flight[key] = self._next
            self._next += 1
            self.stats.admitted_groups += 1

    def _step(self) -> None:
        before = self.generator.scheduler.stats.steps
        finished = self.generator.step()
        self._steps += 1
        seqs = self.generator.scheduler.stats.seqs_per_step
        if self.generator.scheduler.stats.steps > before:
            self.stats.decode_steps += 1
            self.stats.decode_rows += seqs[-1]
        self._collect(finished)

    def _collect(self, finished: list[RequestOutput]) -> None:
        """Queue the groups among ``finished`` for the trainer, stamped with the generator step that
        ended them (then ordered by admission): never the wall clock."""
        done = [
            FinishedGroup(self._in_flight.pop(out.request_id), out, self._steps)
            for out in finished
            if out.request_id in self._in_flight
        ]
        if self.episodes is not None:  # (an aborted group is no longer in flight: ignored)
            done += [
                FinishedGroup(self._in_flight.pop(group), None, self._steps, episodes)
                for group, episodes in self.episodes.take_finished()
                if group in self._in_flight
            ]
        self._ready.extend(sorted(done, key=lambda g: g.index))

    def _sequences(self, key) -> list:
        """The live samples of an in-flight group (their policy versions so far)."""
        if self.episodes is not None:
            return self.episodes.sequences(key)
        return [seq for seq in self.generator.request(key).samples if seq is not None]

    def _abort(self, key) -> None:
        if self.episodes is not None:
            self.episodes.abort(key)
        else:
            self.generator.abort(key)

    def _refuse_episode_checkpoint(self) -> None:
        if self.episodes is not None:
            raise NotImplementedError(
                "a checkpoint of streaming tool episodes is not supported: an episode in flight holds "
                "running tools and environments that cannot be saved; checkpoint a synchronous run "
                "(rollout.mode=sync) or a single-turn streaming one"
            )

    def _drop_stale(self) -> None:
        """Drop finished groups too old to train on now (their oldest token > max_staleness steps)."""
        now, keep = self.policy_version, []
        for group in self._ready:
            oldest = group.oldest_version
            if oldest is not None and now - oldest > self.max_staleness:
                self.stats.dropped_groups += 1
                self.stats.dropped_tokens += group.num_tokens
                logger.debug(
                    "dropped group %d: oldest token %d steps old (max_staleness=%d)",
                    group.index,
                    now - oldest,
                    self.max_staleness,
                )
            else:
                keep.append(group)
        self._ready = keep


def _check_gathered(model) -> None:
    """The fence between decoding and training: decode steps run only on gathered weights. On weights
    still sharded over several ranks each forward would join per-layer collectives that the other
    ranks (decoding a different number of steps, or in their training step) never join: a hang."""
    kind = sharded_weights(model)
    if kind is not None and world_size() > 1:
        raise RuntimeError(
            f"streaming rollouts on weights sharded ({kind}) over {world_size()} ranks would hang: each "
            "rank decodes its own number of steps. Call stream.next_groups() inside "
            "`with nopad.inference.sharded.gathered_weights(model):` on every rank (streaming_step does)"
        )


def check_streaming(max_staleness: int, stale_kv: str) -> None:
    """The streaming settings' one check (the recipe's config calls it too)."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0 (0: synchronous GRPO), got {max_staleness!r}")
    if stale_kv not in STALE_KV:
        raise ValueError(f"stale_kv must be one of {STALE_KV}, got {stale_kv!r}")


def streaming_step(
    stepper,
    stream: StreamingRollouts,
    group_examples: Callable[[int], tuple[dict, list[int]]],
    reward_fn,
    tokenizer,
    loss,
    *,
    step: int,
    temperature: float,
    ref_model=None,
    episode_reward: bool = False,
) -> dict:
    """One streaming GRPO step: the next groups from ``stream`` (``group_examples(i)``: the example and
    prompt ids of group ``i``; ``episode_reward``: tool episodes are rewarded whole, as
    ``ToolEpisodes.episode_reward``), scored and trained as the synchronous step does
    (:func:`nopad.training.grpo_step.score_and_train`, each token's own recorded behaviour log-prob as
    its old log-prob), then the generator is told the weights changed. Every rank calls it each step.
    Under ZeRO-3 / FSDP2 the step's generator steps run on the full weights, gathered once for them
    (:func:`nopad.inference.sharded.gathered_weights`, a collective every rank joins once a step), so
    each rank decodes its own groups with no collective per forward. The fence: every decode step runs
    inside that block, the weights sharded again before the training forwards and the optimizer step
    begin, and the generator is told of the update only after the step has ended on this rank."""
    import time

    from nopad.packing.invariance import batch_invariant
    from nopad.training.grpo import Rollout
    from nopad.training.grpo_episodes import episode_sample, tool_metrics
    from nopad.training.grpo_step import score_and_train

    window, t0 = stream.snapshot(), time.perf_counter()
    with gathered_weights(stepper.model), batch_invariant(loss.batch_invariant):  # (bitwise the trainer's)
        groups = stream.next_groups()
    rollout_time = time.perf_counter() - t0
    examples, samples = [], []
    for group in groups:
        example, prompt_ids = group_examples(group.index)
        examples.append(example)
        if group.episodes is not None:  # tool episodes: the tools' tokens are context, not trained on
            samples.append([episode_sample(ep, episode_reward, loss.logprobs) for ep in group.episodes])
        else:
            samples.append(
                [(c.token_ids, Rollout.from_completion(prompt_ids, c, loss.logprobs)) for c in group.output.outputs]
            )
    metrics = score_and_train(
        stepper, samples, examples, reward_fn, tokenizer, loss, step=step, temperature=temperature, ref_model=ref_model
    )
    stream.weights_updated(metrics["optimizer_steps"])
    episodes = [ep for group in groups for ep in group.episodes or ()]
    return {
        **metrics,
        **(tool_metrics(episodes) if stream.episodes is not None else {}),
        **stream.metrics(window),
        "rollout_s": rollout_time,
        "rollout_tokens_per_s": metrics["completion_tokens"] / max(rollout_time, 1e-9),
    }
