"""Request validation: :class:`RequestBuilder` checks prompts and sampling parameters against what the
generator can serve and turns them into :class:`~nopad.inference.request.Request` s; bad input raises
before anything is queued."""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from dataclasses import dataclass

import torch

from nopad.inference.request import Request
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.seeding import request_seed


def prompt_token_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Validate a prompt (a string, taken as-is, or token ids) and return its token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer; pass tokenizer= or token ids")
        ids = list(tokenizer(prompt)["input_ids"])
    elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab_size}); got {bad[0]!r}")
    else:
        raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty; give at least one token")
    return ids


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config, else the model config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}
    return set()


@dataclass
class RequestBuilder:
    """Validates prompts and sampling parameters into :class:`Request` s against what the
    generator can serve: its tokenizer and vocabulary, the model's context, the KV cache
    (``num_blocks`` of ``block_size``) and ``max_num_seqs``. Bad input raises ValueError here,
    before anything is queued."""

    tokenizer: object | None
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: set[int]
    max_logprobs: int = 20  # the most top log-probs per position a request may ask for (vLLM's cap)
    next_id: int = 0

    def __post_init__(self) -> None:
        cap = self.max_logprobs
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise ValueError(
                f"max_logprobs must be an int >= 0 (the most top log-probs a request may ask for), got {cap!r}"
            )

    def build_all(self, prompts, sampling_params, in_flight: Container[str] = ()) -> list[Request]:
        """One request per prompt (a single prompt may be given bare); ``sampling_params`` is one
        for all or one per prompt. A bad prompt is named by its index."""
        if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Mapping):  # list(dict) would iterate its keys
            raise TypeError(
                f"sampling_params is a dict/mapping {dict(sampling_params)!r}; pass "
                f"SamplingParams(**{dict(sampling_params)!r}) (one for all prompts, or a list)"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one for all or one per prompt"
                )
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                requests.append(self.build(prompt, p, None, in_flight))
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None
        return requests

    def build(
        self, prompt, params: SamplingParams | None, request_id: str | None, in_flight: Container[str] = ()
    ) -> Request:
        """One validated request; ``request_id`` None takes the next free number."""
        if params is None:
            params = SamplingParams()
        if isinstance(params, Mapping):
            raise TypeError(
                f"sampling params is a dict/mapping {dict(params)!r}; pass SamplingParams(**{dict(params)!r})"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        self._check(ids, params)
        if request_id is None:
            while str(self.next_id) in in_flight:
                self.next_id += 1
            request_id = str(self.next_id)
            self.next_id += 1
        elif request_id in in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        return Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            ids,
            params,
            request_seed(params.seed),
            time.perf_counter(),
            frozenset(stop_ids),
        )

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        capacity = self.num_blocks * self.block_size
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the model's max_position_embeddings is "
                f"{self.max_model_len} (and at least one token must be generated); shorten it"
            )
        if len(ids) >= capacity:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the whole KV cache holds {capacity} "
                f"({self.num_blocks} blocks of {self.block_size}); give the Generator "
                "more num_blocks/kv_memory_bytes or shorten the prompt"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.max_num_seqs}")
        for name in ("logprobs", "prompt_logprobs"):
            if (k := getattr(params, name)) is not None and k > self.max_logprobs:
                raise ValueError(
                    f"{name}={k} is more than the Generator's max_logprobs={self.max_logprobs} "
                    f"(each position would hold a dict of {k} tokens); ask for at most "
                    f"{self.max_logprobs}, or raise the cap: Generator(..., max_logprobs={k})"
                )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= or use stop_token_ids")
        for t in params.stop_token_ids:
            if t >= self.vocab_size:
                raise ValueError(f"stop token id {t} is outside the vocabulary (size {self.vocab_size})")
