"""Prompt log-probs (``SamplingParams(prompt_logprobs=k)``, as vLLM): the raw log-prob of every
prompt token after the first, and the ``k`` most likely tokens at its position.

Where they come from: a prefill chunk of a request that asks keeps the hidden states of its
prompt positions (:func:`prompt_span` names them; the model runner adds them to ``logits_to_keep``
and :func:`prompt_hidden` takes them from the head's input, so a request that does not ask costs
nothing), and :func:`score_prompts` runs the model's head on them and the one log-softmax of nopad
(:func:`packing.log_softmax.tempered_log_softmax`, the trainer's and the sampler's)
:data:`packing.lm_head.CHUNK_TOKENS` rows at a time: memory O(chunk x V) whatever the prompt's
length, as the trainer's chunked head (vLLM computes a whole prefill chunk's logits).

Entries are stored on the request by position, in order: a chunk scores only the positions past
those already stored, so a preempted sequence that recomputes its prompt (or a fork of a request
that recomputes after preemption) neither duplicates nor skips one. A request whose entries are
incomplete reads no prefix-cache hit (:attr:`inference.request.Request.scoring_prompt`): a cached
block's positions are never computed, so they could not be scored (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from packing.lm_head import CHUNK_TOKENS, _head_mismatch, head_of
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


@contextmanager
def prompt_hidden(model: torch.nn.Module, num_sampling: int, active: bool) -> Iterator[dict]:
    """While ``model`` runs a step whose ``logits_to_keep`` holds ``num_sampling`` sampling rows then
    the prompt rows: its head module computes the sampling rows and the first prompt row only (that
    one row checks :func:`score_prompts`' head against the model's logits), and the prompt rows'
    hidden states are kept in the yielded dict (``"hidden"``, with ``"head"``). Nothing when not
    ``active``."""
    kept: dict = {}
    if not active:
        yield kept
        return
    head = kept["head"] = head_of(model)

    def keep(module, args):
        hidden = args[0]
        kept["hidden"] = hidden.reshape(-1, hidden.shape[-1])[num_sampling:]
        return (hidden[..., : num_sampling + 1, :], *args[1:])

    handle = head.module.register_forward_pre_hook(keep)
    try:
        yield kept
    finally:
        handle.remove()


def score_prompts(kept: dict, first_row_logits: torch.Tensor, spans: list[Span], model) -> None:
    """Append to each span's request the entries of its tokens (``{token: log-prob}`` of the prompt
    token plus the top-k) from the prompt rows' hidden states that :func:`prompt_hidden` kept (one
    row per token scored, the spans' rows in order): the model's head
    (:class:`packing.lm_head.LMHead`, its final-logit ops included) and the one log-softmax,
    :data:`~packing.lm_head.CHUNK_TOKENS` rows at a time, so no ``(rows, V)`` tensor is larger than
    a chunk's. ``first_row_logits``: the model's own logits of the first prompt row; a model whose
    logits the head does not reproduce is refused (no silently wrong log-probs)."""
    head, hidden = kept["head"], kept.get("hidden")
    total = sum(count for _, _, count in spans)
    if hidden is None or hidden.shape[0] != total:
        raise RuntimeError(f"{type(model).__name__}'s head did not get the {total} prompt rows of "
                           "logits_to_keep; prompt_logprobs needs a causal LM that takes logits_to_keep as a "
                           "tensor of positions")
    mismatch = _head_mismatch(head, head.logits(hidden[:1]), first_row_logits[None], model)
    if mismatch:
        raise ValueError(f"prompt_logprobs: {mismatch}")
    at = 0
    for request, first, count in spans:
        k = request.params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[first: first + count], device=hidden.device)
        for start in range(0, count, CHUNK_TOKENS):
            stop = min(start + CHUNK_TOKENS, count)
            logp = tempered_log_softmax(head.logits(hidden[at + start: at + stop]))
            picked, _ = picked_and_entropy(logp, targets[start:stop], False)
            top_vals, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
            tokens = targets[start:stop].tolist()
            for token, value, ids, vals in zip(tokens, picked.tolist(), top_ids.tolist(), top_vals.tolist()):
                entry = dict(zip(ids, vals))
                entry.setdefault(token, value)
                request.prompt_logprobs.append(entry)
        at += count
