"""How to sample one request: vLLM-style parameters, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Sampling parameters of one request (all ``n`` samples share them).

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 (as vLLM), ``top_p=1`` and ``min_p=0`` disable those
    filters. ``seed`` makes the request reproducible whatever else is in the batch (sample ``i``
    of a request draws from the counter-based stream ``(seed, i, position)``); without it a seed
    is drawn at ``add_request``. ``logprobs=k`` also returns the k most likely tokens (raw model
    log-probs) at every position. ``prompt_logprobs=k`` (as vLLM's) returns
    ``RequestOutput.prompt_logprobs``: every prompt token's raw log-prob and the k most likely
    tokens at its position (:mod:`nopad.inference.prompt_logprobs`); such a request computes its whole
    prompt (no prefix-cache hit; vLLM does the same) and scores its prompt positions' hidden
    states with the chunked head. Unlike vLLM, -1 (the whole vocabulary) is not taken. Both ``k``
    are capped by the Generator's ``max_logprobs`` (vLLM's cap, default 20), checked when a request
    is added. ``stop`` strings need a tokenizer; the returned text ends before the stop string, the
    token ids keep every generated token.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _int("n", self.n, 1)
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or math.isnan(t) or t < 0 or math.isinf(t):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 or -1 to disable it, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p!r}")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or math.isnan(rp) or math.isinf(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {rp!r}")
        _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) for s in self.stop):
            self.stop = list(self.stop)
        else:
            raise ValueError(
                f"stop must be a string or a list of strings, got {type(self.stop).__name__}: {self.stop!r}; "
                "pass token ids as stop_token_ids"
            )
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.seed is not None:
            _int("seed", self.seed, None)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0)
        if self.prompt_logprobs == -1 and not isinstance(self.prompt_logprobs, bool):
            raise ValueError("prompt_logprobs=-1 (vLLM's whole vocabulary) is not supported; pass k >= 0")
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _int(name: str, value, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
