"""Prompt log-probs (``SamplingParams(prompt_logprobs=k)``, as vLLM): the raw log-prob of every
prompt token after the first, and the ``k`` most likely tokens at its position.

Where they come from: a prefill chunk of a request that asks keeps the hidden states of its
prompt positions (:func:`prompt_span` names them; the model runner adds them to ``logits_to_keep``
and :class:`PromptScorer` takes them from the head's input, so a request that does not ask costs
nothing) and runs the model's head on them and the one log-softmax of nopad
(:func:`nopad.packing.head.log_softmax.tempered_log_softmax`, the trainer's and the sampler's)
:data:`nopad.packing.head.chunked.CHUNK_TOKENS` rows at a time: memory O(chunk x V) whatever the prompt's
length, as the trainer's chunked head (vLLM computes a whole prefill chunk's logits).

Entries are stored on the request by position, in order: a chunk scores only the positions past
those already stored, so a preempted sequence that recomputes its prompt neither duplicates nor
skips one (the ``n`` samples fork once the prompt is scored). A request whose entries are
incomplete reads no prefix-cache hit (:attr:`nopad.inference.request.Request.scoring_prompt`): a cached
block's positions are never computed, so they could not be scored (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from nopad.packing.head.chunked import CHUNK_TOKENS
from nopad.packing.head.log_softmax import picked_and_entropy, tempered_log_softmax
from nopad.packing.head.model_head import head_mismatch, head_of

if TYPE_CHECKING:
    from nopad.inference.request import Request, Sequence

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
        raise RuntimeError(
            f"request {request.request_id}: prompt log-probs stored up to token {first} but "
            f"its prefill resumes at {seq.num_computed}; this is a bug"
        )
    end = min(seq.num_computed + num_new, len(request.prompt_token_ids) - 1)  # last token scored
    return (request, first, end - first + 1) if end >= first else None


class PromptScorer:
    """Scores one step's prompt rows (``spans``, kept in ``logits_to_keep`` after its
    ``num_sampling`` sampling rows) inside the model's call, in hooks on its head module: the
    head's input is kept and the module computes the sampling rows and the first prompt row only;
    then, while the module runs (its weights gathered, under ZeRO-3 or FSDP2: no collective of
    its own, so ranks in lockstep stay in step), the prompt rows' hidden states go through the
    model's head (:class:`nopad.packing.head.model_head.LMHead`, its final-logit ops included) and the one
    log-softmax, :data:`~nopad.packing.head.chunked.CHUNK_TOKENS` rows at a time: no ``(rows, V)`` tensor
    larger than a chunk's. :meth:`commit` checks the head's first prompt row against the model's
    own logits before any entry is stored (a model whose forward changes its logits after the head
    is refused, not scored wrongly). No spans: it does nothing (a step without prompt rows)."""

    def __init__(self, model: torch.nn.Module, num_sampling: int, spans: list[Span]):
        self.model, self.num_sampling, self.spans = model, num_sampling, spans
        self.head = head_of(model) if spans else None
        self.hidden: torch.Tensor | None = None
        self.entries: list[list[dict[int, float]]] | None = None
        self.ours: torch.Tensor | None = None  # the head's logits of the first prompt row

    @contextmanager
    def hooked(self) -> Iterator[None]:
        if not self.spans:
            yield
            return
        module = self.head.module
        handles = [
            module.register_forward_pre_hook(self._keep),
            module.register_forward_hook(self._score, prepend=True),
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _keep(self, module, args):
        hidden = args[0]
        self.hidden = hidden.reshape(-1, hidden.shape[-1])[self.num_sampling :]
        return (hidden[..., : self.num_sampling + 1, :], *args[1:])

    def _score(self, module, args, output):
        total = sum(count for _, _, count in self.spans)
        if self.entries is not None or self.hidden is None or self.hidden.shape[0] != total:
            raise RuntimeError(
                f"{type(self.model).__name__}'s head did not get the {total} prompt rows of "
                "logits_to_keep once; prompt_logprobs needs a causal LM that takes "
                "logits_to_keep as a tensor of positions and calls its head once"
            )
        # a copy: the model's logits may be this very tensor, and what changes them in place counts
        self.ours = self.head.finish(output.reshape(-1, output.shape[-1])[self.num_sampling :][:1]).clone()
        self.entries = [self._entries(*span, at) for span, at in zip(self.spans, _starts(self.spans))]
        self.hidden = None

    def _entries(self, request: Request, first: int, count: int, at: int) -> list[dict[int, float]]:
        k = request.params.prompt_logprobs
        targets = torch.tensor(request.prompt_token_ids[first : first + count], device=self.hidden.device)
        entries = []
        for start in range(0, count, CHUNK_TOKENS):
            stop = min(start + CHUNK_TOKENS, count)
            logp = tempered_log_softmax(self.head.logits(self.hidden[at + start : at + stop], hooks=False))
            picked, _ = picked_and_entropy(logp, targets[start:stop], False)
            top_vals, top_ids = logp.topk(min(k, logp.shape[1]), dim=-1)
            tokens = targets[start:stop].tolist()
            for token, value, ids, vals in zip(tokens, picked.tolist(), top_ids.tolist(), top_vals.tolist()):
                entry = dict(zip(ids, vals))
                entry.setdefault(token, value)  # the prompt token is in, top-k or not (as vLLM)
                entries.append(entry)
        return entries

    def commit(self, logits: torch.Tensor) -> None:
        """Store the entries on their requests, once the head's first prompt row is found equal
        to the model's own (of the step's ``logits``, the row after the sampling rows)."""
        if not self.spans:
            return
        if self.entries is None:
            raise RuntimeError(
                f"{type(self.model).__name__}'s forward did not call its output embeddings "
                "(get_output_embeddings()); prompt_logprobs needs the usual causal-LM forward"
            )
        theirs = logits.reshape(-1, logits.shape[-1])[self.num_sampling :][:1]
        mismatch = head_mismatch(self.head, self.ours, theirs, self.model)
        if mismatch:
            raise ValueError(f"prompt_logprobs: {mismatch}")
        for (request, _, _), entries in zip(self.spans, self.entries):
            request.prompt_logprobs.extend(entries)


def _starts(spans: list[Span]) -> list[int]:
    starts, at = [], 0
    for _, _, count in spans:
        starts.append(at)
        at += count
    return starts
