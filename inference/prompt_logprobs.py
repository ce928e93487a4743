"""Prompt log-probs (``SamplingParams(prompt_logprobs=k)``, as vLLM): the raw log-prob of every
prompt token after the first, and the ``k`` most likely tokens at its position.

Where they come from: a prefill chunk of a request that asks keeps the logits of its prompt
positions (:func:`prompt_spans` names them; the model runner adds them to ``logits_to_keep``, so
a request that does not ask costs nothing), and :func:`score_prompts` turns them into entries with
the one log-softmax of nopad (:func:`packing.log_softmax.tempered_log_softmax`, the trainer's and
the sampler's), :data:`packing.lm_head.CHUNK_TOKENS` rows at a time, so its fp32 temporaries are
one chunk's whatever the prompt's length.

Entries are stored on the request by position, in order: a chunk scores only the positions past
those already stored, so a preempted sequence that recomputes its prompt (or a fork of a request
that recomputes after preemption) neither duplicates nor skips one. A request whose entries are
incomplete reads no prefix-cache hit (:attr:`inference.request.Request.scoring_prompt`): a cached
block's positions are never computed, so they could not be scored (vLLM does the same).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from packing.lm_head import CHUNK_TOKENS
from packing.log_softmax import picked_and_entropy, tempered_log_softmax

if TYPE_CHECKING:
    from inference.request import Request, Sequence

# (request, first prompt token scored, how many): one plan entry's kept rows, in row order
Span = tuple["Request", int, int]


def prompt_span(seq: Sequence, num_new: int) -> Span | None:
    """The prompt tokens a chunk of ``num_new`` tokens of ``seq`` scores: token ``j`` is predicted
    at position ``j - 1``, so positions ``[num_computed, num_computed + num_new)`` score tokens
    ``num_computed + 1 ..`` up to the last prompt token, from the first not yet stored."""
    request = seq.request
    if not request.scoring_prompt:
        return None
    first = len(request.prompt_logprobs)
    if seq.num_computed + 1 > first:
        raise RuntimeError(f"request {request.request_id}: prompt log-probs stored up to token {first} but "
                           f"its prefill resumes at {seq.num_computed}; this is a bug")
    end = min(seq.num_computed + num_new, len(request.prompt_token_ids) - 1)  # last token scored
    return (request, first, end - first + 1) if end >= first else None


def score_prompts(logits: torch.Tensor, spans: list[Span]) -> None:
    """Append to each span's request the entries of its tokens from ``logits`` (one row per token
    scored, the spans' rows in order): ``{token: log-prob}`` of the prompt token plus the top-k."""
    at = 0
    for request, first, count in spans:
        k = request.params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[first: first + count], device=logits.device)
        for start in range(0, count, CHUNK_TOKENS):
            stop = min(start + CHUNK_TOKENS, count)
            logp = tempered_log_softmax(logits[at + start: at + stop])
            picked, _ = picked_and_entropy(logp, targets[start:stop], False)
            top_vals, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
            tokens = targets[start:stop].tolist()
            for token, value, ids, vals in zip(tokens, picked.tolist(), top_ids.tolist(), top_vals.tolist()):
                entry = dict(zip(ids, vals))
                entry.setdefault(token, value)
                request.prompt_logprobs.append(entry)
        at += count
    if at != logits.shape[0]:
        raise RuntimeError(f"{logits.shape[0]} prompt rows kept for {at} prompt tokens; this is a bug")
