"""Request and sequence state: what the scheduler moves between waiting, running and finished.

A request with ``n`` samples enters as ONE sequence holding the prompt (``fork_count = n``);
when its prompt prefill completes it is forked into ``n`` sequences that share every prompt
block, so the prompt is computed once. A preempted sequence goes back to waiting as itself,
with prompt + generated tokens to recompute and its outputs kept. A sequence knows its own stop
conditions (:meth:`Sequence.stop_reason`); its owner (:class:`SequenceHooks`) decides what a
stop means. :class:`~nopad.inference.request_builder.RequestBuilder` validates what a request may
ask of the generator.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

from nopad.inference.outputs import CompletionOutput, RequestOutput, StreamDelta
from nopad.inference.sampling_params import SamplingParams
from nopad.packing.blocks import NO_PARENT

logger = logging.getLogger(__name__)
_seq_ids = itertools.count()


class SequenceHooks(Protocol):
    """What the owner of a sequence does when the scheduler's postprocess reaches one of its
    events: plain requests collect their outputs, tool episodes (:class:`nopad.inference.episodes.
    EpisodeRunner`) pause, run tools, resume and fork. The scheduler calls these and never asks
    what kind of sequence it holds."""

    def forked(self, parent: Sequence, children: list[Sequence]) -> None:
        """``parent``'s group was split: ``children`` are its new members."""

    def turn_ended(self, seq: Sequence, reason: str) -> None:
        """A sampled token ended the model's turn ("stop" or "length"); the owner finishes the
        sequence (``Scheduler.finish``) or pauses it (``Scheduler.pause``)."""

    def stopped(self, seq: Sequence) -> None:
        """The scheduler finished ``seq`` itself: alone, it outgrew the KV cache."""

    def poll(self, block: bool) -> None:
        """Resume paused sequences whose work returned (``Scheduler.resume``); ``block``: nothing
        else can run, so wait for one instead of spinning."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"  # an episode waiting on its tools: keeps its blocks unless preempted
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One prompt and its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the request's seed (given or drawn): sample i draws from (seed, i, position)
    arrival_time: float
    stop_ids: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    samples: list[Sequence | None] = field(default_factory=list)
    num_finished: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # by position (nopad.inference.prompt_logprobs)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n

    @property
    def scoring_prompt(self) -> bool:
        """It asked for prompt log-probs and some are still to be computed (so it must not read
        prefix-cache hits: their positions would never be scored)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def output(self, detokenize=None) -> RequestOutput:
        outs = []
        for i, seq in enumerate(self.samples):
            if seq is None:  # aborted before its prompt was prefilled and forked
                outs.append(CompletionOutput(i, [], "" if detokenize else None, "abort"))
            else:
                outs.append(seq.completion(detokenize))
        prompt_logprobs = None if self.prompt_logprobs is None else list(self.prompt_logprobs)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, self.finished, prompt_logprobs)

    def first_sequence(self, hooks: SequenceHooks) -> Sequence:
        """The request's one sequence, owned by ``hooks``, until its prompt is prefilled and it
        is forked into its ``n`` samples."""
        seq = Sequence(
            request=self, index=0, token_ids=list(self.prompt_token_ids), fork_count=self.params.n, hooks=hooks
        )
        self.samples = [seq] + [None] * (self.params.n - 1)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # vLLM's shape: the first token has no prediction
        return seq

    def deltas(self) -> list[StreamDelta]:
        """The new tokens of every sample since the last call (one delta per sample that has
        some); a sample's last delta carries its finish reason."""
        out = []
        for seq in self.samples:
            if seq is None or seq.emitted < 0:
                continue
            new = seq.generated[seq.emitted :]
            done = seq.status is Status.FINISHED
            if new or done:
                out.append(StreamDelta(self.request_id, seq.index, new, seq.finish_reason if done else None))
                seq.emitted = -1 if done else seq.emitted + len(new)
        if self.finished:  # samples aborted before the prompt was forked
            out += [StreamDelta(self.request_id, i, [], "abort") for i, seq in enumerate(self.samples) if seq is None]
        return out


# what a fork does not inherit: its own group size, stop, stream position, episode and state slot
FORK_RESETS = {
    "fork_count": 1,
    "finish_reason": None,
    "stop_text": None,
    "emitted": 0,
    "out_of_memory": False,
    "episode": None,
    "state_slot": None,
    "snapshot_at": 0,
}


@dataclass(eq=False)
class Sequence:
    """One sample: its tokens, how many of them have K/V in the cache, and its blocks."""

    request: Request
    index: int  # sample index within the request
    token_ids: list[int]
    fork_count: int = 1
    stream: int | None = None  # random stream of its draws (default: index); forks get their own
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V is in the cache
    block_table: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading full blocks registered in the prefix cache
    last_hash: int = NO_PARENT
    finish_reason: str | None = None
    stop_text: str | None = None  # the stop string that ended it, if any
    logprobs: list[float] = field(default_factory=list)
    temperature_logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # per sampled token: the weights that drew it
    token_times: list[float] = field(default_factory=list)
    emitted: int = 0  # generated tokens already handed to a stream
    turn_start: int | None = None  # where the current model turn began (default: after the prompt)
    max_generated: int | None = None  # an episode's budget of tokens after the prompt
    out_of_memory: bool = False  # stopped by the scheduler: alone, it did not fit in the cache
    hooks: SequenceHooks | None = None  # its owner: the scheduler's postprocess calls it
    episode: object | None = None  # the episode state (nopad.inference.episodes) of an episode's sequence
    state_slot: int | None = None  # its per-sequence state slot (hybrid models: nopad.inference.state_cache)
    snapshot_at: int = 0  # a cached prefix end with no state snapshot: its prefill leaves one there

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = self.index
        if self.turn_start is None:
            self.turn_start = len(self.request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_turn_tokens(self) -> int:
        """Tokens sampled in the current turn (all generated tokens for a plain request)."""
        return len(self.token_ids) - self.turn_start

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before this sequence can sample."""
        return len(self.token_ids) - self.num_computed

    def fork(self, index: int, stream: int | None = None) -> Sequence:
        """A sibling sharing this sequence's blocks and history (the caller increfs the blocks): every
        field copied (lists as copies) except the sample's own identity and what its owner and the
        scheduler give it afresh (:data:`FORK_RESETS`)."""
        child = dataclasses.replace(self, index=index, stream=stream, seq_id=next(_seq_ids), **FORK_RESETS)
        for f in dataclasses.fields(child):
            value = getattr(child, f.name)
            if isinstance(value, list):
                setattr(child, f.name, list(value))
        return child

    def append(self, result, k: int, now: float) -> None:
        """Append row ``k`` of a step's sample (:class:`nopad.inference.sampler.SampleResult`) and the
        policy version that drew it."""
        self.token_ids.append(result.tokens[k])
        self.policy_versions.append(result.policy_version)
        self.logprobs.append(result.logprobs[k])
        self.temperature_logprobs.append(result.temperature_logprobs[k])
        self.sampling_logprobs.append(result.sampling_logprobs[k])
        if self.request.params.logprobs is not None:
            self.top_logprobs.append(result.top_logprobs[k])
        self.token_times.append(now - self.request.arrival_time)

    def stop_reason(self, tokenizer, max_model_len: int) -> str | None:
        """Why the token just appended ends the model's turn ("stop", "length"), or None."""
        request, params = self.request, self.request.params
        if self.token_ids[-1] in request.stop_ids:
            return "stop"
        if params.stop and self._hit_stop_string(tokenizer):
            return "stop"
        num_tokens = len(self.token_ids)  # not the properties: this runs for every row, every step
        if num_tokens - self.turn_start >= params.max_tokens:
            return "length"
        if self.max_generated is not None and self.num_generated >= self.max_generated:
            return "length"
        if num_tokens >= max_model_len:
            logger.warning(
                "request %s sample %d stopped after %d of max_tokens=%d new tokens: prompt and "
                "completion reached the model's context of %d tokens (max_position_embeddings); "
                "shorten the prompt for a longer completion",
                request.request_id,
                self.index,
                self.num_generated,
                params.max_tokens,
                max_model_len,
            )
            return "length"
        return None

    def _hit_stop_string(self, tokenizer) -> bool:
        stops = self.request.params.stop
        window = max(len(s) for s in stops) + 8
        tail = tokenizer.decode(self.token_ids[self.turn_start :][-window:], skip_special_tokens=False)
        for s in stops:
            if s in tail:
                self.stop_text = s
                return True
        return False

    def completion(self, detokenize=None) -> CompletionOutput:
        text = None
        if detokenize is not None:
            text = detokenize(self.generated, self.request.params.skip_special_tokens)
            if self.stop_text is not None:
                cut = text.find(self.stop_text)
                if cut >= 0:
                    text = text[:cut]
        return CompletionOutput(
            index=self.index,
            token_ids=self.generated,
            text=text,
            finish_reason=self.finish_reason,
            logprobs=list(self.logprobs),
            temperature_logprobs=list(self.temperature_logprobs),
            sampling_logprobs=list(self.sampling_logprobs),
            top_logprobs=list(self.top_logprobs) if self.request.params.logprobs is not None else None,
            policy_versions=list(self.policy_versions),
            first_token_time=self.token_times[0] if self.token_times else None,
            token_times=list(self.token_times),
        )
