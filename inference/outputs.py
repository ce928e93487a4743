"""What the generator returns: vLLM-shaped request and completion records, and streaming deltas."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request.

    ``logprobs[i]`` is the log-prob of ``token_ids[i]`` under the raw model distribution (what a
    trainer's forward computes); ``temperature_logprobs[i]`` under ``softmax(logits / temperature)``
    before repetition penalty and top-k/top-p/min-p truncation (what TRL's GRPO trainer scores; the
    raw log-prob at temperature 1 or greedy); ``sampling_logprobs[i]`` under the processed
    distribution it was actually drawn from (after repetition penalty, temperature, top-k, top-p,
    min-p; 0.0 for greedy). ``top_logprobs[i]`` maps the top-k tokens to raw log-probs when requested.
    ``policy_versions[i]`` is the :attr:`~nopad.inference.Generator.policy_version` whose weights drew
    ``token_ids[i]`` (streaming RL: optimizer steps may land between two tokens of one sample).
    Times are seconds since the request arrived.
    """

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop", "length" or "abort"
    logprobs: list[float] = field(default_factory=list)
    temperature_logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    policy_versions: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All samples of one request, ordered by sample index.

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` asked for them, else None) has
    vLLM's shape: one entry per prompt token, None for the first (nothing predicts it), then a dict
    of the prompt token's raw log-prob and the top-k tokens' at its position (the prompt token is
    in it whether or not it is in the top-k). Where vLLM differs: its values are ``Logprob``
    objects (log-prob, rank, decoded text); here they are floats, as in ``top_logprobs``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one sample since the last delta; ``finish_reason`` is set on its last."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
