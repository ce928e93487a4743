"""What the sampler reads from each row of a step: :class:`RowsPlan`, worked out from the rows'
sampling parameters by :func:`plan_rows`. Why a record of its own: a batch that keeps decoding
(:mod:`nopad.inference.decode_batch`) works it out once, not once a step (each is a walk over every
row in Python); :func:`nopad.inference.sampler.sample_on_device` works it out when it is not given."""

from __future__ import annotations

from dataclasses import dataclass

from nopad.inference.request import Sequence


@dataclass
class RowsPlan:
    """What the sampler reads from each row's parameters (see the module's docstring)."""

    vocab: int
    params: list
    greedy: list[int]  # rows at temperature 0
    rand: list[int]  # the others
    rand_params: list
    reshapes: bool  # a random row's temperature, top-k, top-p or min-p changes its distribution
    tempered: bool  # a random row's temperature is not 1
    penalized: list[int]  # rows with a repetition penalty
    bans: list[int]  # rows with min_tokens: the per-row walk bans their stop ids until they have them
    top_rows: list[int]  # rows asking for top log-probs


def plan_rows(seqs: list[Sequence], vocab: int) -> RowsPlan:
    """:class:`RowsPlan` of ``seqs`` for logits of ``vocab`` columns (lists, not generators: no Python
    call per row)."""
    params = [s.request.params for s in seqs]
    is_greedy = [p.temperature == 0 for p in params]  # SamplingParams.greedy, read once per row
    rand = [i for i, g in enumerate(is_greedy) if not g]
    rand_params = [params[i] for i in rand]
    return RowsPlan(
        vocab=vocab,
        params=params,
        greedy=[i for i, g in enumerate(is_greedy) if g],
        rand=rand,
        rand_params=rand_params,
        reshapes=any([changes_distribution(p, vocab) for p in rand_params]),
        tempered=bool({p.temperature for p in rand_params} - {1.0}),
        penalized=[i for i, p in enumerate(params) if p.repetition_penalty != 1.0],
        bans=[i for i, p in enumerate(params) if p.min_tokens > 0],
        top_rows=[i for i, p in enumerate(params) if p.logprobs is not None],
    )


def changes_distribution(p, vocab: int) -> bool:
    """``p`` changes the distribution before sampling (temperature, top-k, top-p, min-p)."""
    return p.temperature != 1.0 or 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0
