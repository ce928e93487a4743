"""The decode step's sampler inside its compiled graph: the forward, the draw and the log-probs as one
graph, so a steady decode step launches one CUDA graph and no sampler kernel after it.

Why: with ``compile_decode`` on CUDA the forward is one graph replay, and the eager sampler after it
(log-softmax, argmax, gather, and for sampled rows the tempered log-softmax, the CDF and its search) was
a dozen more launches on the step's critical path. Inside the graph they are fused and replayed.

What it serves: every row of a steady decode batch -- greedy, a temperature, top-k, top-p and min-p in
any mix, top log-probs, and repetition penalties (from the batch's device mask of each row's tokens,
:mod:`nopad.inference.penalties`, read by the graph as it is). The draw is the eager sampler's, op for
op (:func:`draw_rows`): the same counter-based uniforms (drawn in the graph from each row's key, sent with
the step's inputs and the same every step, and its length, :mod:`nopad.inference.seeding`), the same filters
(:mod:`nopad.inference.sampling_filters`' device functions), the same inverse CDF and log-prob
expressions. Under dynamo's eager backend the tokens and log-probs are the eager sampler's bit for bit
(the tests hold it); compiled, they are the compiled kernels' values of the same functions.

No host decision: the eager sampler asks the device one question, whether 1,024 top-p candidates hold
each row's top-p mass (else it sorts the whole vocabulary). The graph computes both answers and picks one
on the device (:func:`_kept`), and only where a row could lack the mass (top-p without a top-k of its own).
What the graph's shape depends on (the candidates' width, which filters any row uses, the top log-probs'
count) is a :class:`DrawSpec`: one graph per spec, as per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from nopad.inference.penalties import SeenTokens, penalize
from nopad.inference.sampler import PendingSample
from nopad.inference.sampling_filters import TOP_P_CANDIDATES, mask_min_p, mask_top_k_top_p
from nopad.inference.seeding import uniform_tensor
from nopad.packing.head.log_softmax import tempered_log_softmax


class DrawSpec(NamedTuple):
    """What a drawn step's graph is traced for (a different spec is a different graph): whether any row
    samples, the top-k / top-p candidates' width (0: no row filters by either; capped at the vocabulary in
    the graph), whether any row uses top-p, whether one may lack its mass among the candidates (then the
    whole vocabulary is sorted too), whether any uses min-p, the most top log-probs a row asks for, and
    whether any row has a repetition penalty."""

    sampled: bool = False
    width: int = 0
    top_p: bool = False
    full_sort: bool = False
    min_p: bool = False
    top_n: int = 0
    penalty: bool = False


def draw_spec(params: list) -> DrawSpec:
    """The :class:`DrawSpec` of rows with these sampling parameters: the eager sampler's decisions
    (:func:`nopad.inference.sampling_filters.filtered_logprobs`, on the sampled rows)."""
    sampled = [p for p in params if p.temperature != 0]
    max_k = max([p.top_k for p in sampled if p.top_k > 0], default=0)
    top_p = any([p.top_p < 1.0 for p in sampled])
    width = max(max_k, TOP_P_CANDIDATES) if top_p else max_k
    # a top-p row lacks its mass among the candidates only if its own top-k does not bound it
    full_sort = any([p.top_p < 1.0 and not 0 < p.top_k <= width for p in sampled])
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return DrawSpec(
        sampled=bool(sampled),
        width=width,
        top_p=top_p,
        full_sort=full_sort,
        min_p=any([p.min_p > 0 for p in sampled]),
        top_n=max(asked, default=0),
        penalty=any([p.repetition_penalty != 1.0 for p in params]),
    )


@dataclass
class DrawRows:
    """What the graph reads from a decode batch's rows, kept with the batch until a row leaves it: the
    rows' :class:`DrawSpec`, temperatures, random keys, filters and top log-prob counts."""

    spec: DrawSpec
    temperature: np.ndarray  # (rows,) float64, 0: greedy
    keys: np.ndarray | None  # (rows,) int64: each row's stream key's bits (seeding.stream_keys; None: all greedy)
    filters: tuple[np.ndarray, ...] | None  # top_k int64, top_p and min_p float64; greedy rows 0, 1, 0
    tops: list[int | None]  # top log-probs each row asks for (None: none)
    tempered: bool  # some row's temperature is neither 0 nor 1: its tempered log-prob is its own

    @classmethod
    def of(cls, params: list, keys: np.ndarray | None) -> DrawRows:
        """The rows' parameters, and their :func:`nopad.inference.seeding.stream_keys` (uint64; None when
        every row is greedy)."""
        spec = draw_spec(params)
        temperature = np.array([p.temperature for p in params], dtype=np.float64)
        greedy = temperature == 0
        filters = None
        if spec.width or spec.min_p:
            filters = (
                np.where(greedy, 0, [p.top_k for p in params]).astype(np.int64),
                np.where(greedy, 1.0, [p.top_p for p in params]),
                np.where(greedy, 0.0, [p.min_p for p in params]),
            )
        tempered = bool((~greedy & (temperature != 1)).any())
        tops = [p.logprobs for p in params]
        return cls(spec, temperature, None if keys is None else keys.view(np.int64), filters, tops, tempered)


@dataclass
class GraphDraw:
    """A steady decode step's sampling inputs, for the graph: host arrays sent with the step's other inputs
    (:func:`nopad.inference.step_inputs.build_static_decode`), and what the host needs to read its draws.
    Nothing in it changes from step to step but the policy version: each row's uniform is drawn inside the
    graph, from its key and its position."""

    rows: DrawRows
    policy_version: int
    seen: SeenTokens | None = None  # the rows' tokens so far and penalties (with spec.penalty)

    @property
    def spec(self) -> DrawSpec:
        return self.rows.spec

    def columns(self, padded: int) -> list[np.ndarray]:
        """The per-row inputs the graph reads (:func:`draw_rows`' ``inputs``), up to ``padded`` rows: the
        padding rows greedy (temperature 0, key 0) and unfiltered (top-k 0, top-p 1, min-p 0)."""
        if not self.spec.sampled:
            return []
        neutral = (0.0, 0, 0, 1.0, 0.0)
        columns = [self.rows.temperature, self.rows.keys, *(self.rows.filters or ())]
        return [_padded(column, padded, value) for column, value in zip(columns, neutral)]

    def device_inputs(self) -> tuple[torch.Tensor, ...]:
        """The inputs already on the device, after :meth:`columns`' (:func:`draw_rows`' last two): with a
        repetition penalty, the batch's whole mask and penalties (static buffers; the graph reads its rows)."""
        return self.seen.graph_inputs() if self.spec.penalty else ()

    def pending(self, outputs: tuple[torch.Tensor, ...], num: int) -> PendingSample:
        """The graph's outputs for the first ``num`` rows (the rest are padding), as the eager sampler
        returns them: no tempered log-probs when no row's temperature changes them, no sampling
        log-probs when every row is greedy, the top log-probs of the rows that ask."""
        tokens, raw, tempered, sampling = (t[:num] for t in outputs[:4])
        top: list = [None] * num
        if self.spec.top_n:
            values, ids = outputs[4:]
            top = [None if n is None else (values[i, :n], ids[i, :n]) for i, n in enumerate(self.rows.tops)]
        greedy = not self.spec.sampled
        return PendingSample(
            tokens=tokens,
            raw_picked=raw,
            temperature=tempered if self.rows.tempered and not greedy else None,
            sampling=None if greedy else sampling,
            top=top,
            policy_version=self.policy_version,
        )


def _padded(values: np.ndarray, rows: int, value) -> np.ndarray:
    out = np.full(rows, value, dtype=values.dtype)
    out[: values.size] = values
    return out


def draw_rows(
    logits: torch.Tensor, spec: DrawSpec, positions: torch.Tensor, *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Each row's token, its raw log-prob, its log-prob at the row's temperature, its log-prob under the
    distribution it was drawn from (0 for greedy rows), and with ``spec.top_n`` the top raw log-probs'
    values and ids: the eager sampler's expressions (:func:`nopad.inference.sampler.sample_on_device`),
    with no host decision. ``positions``: each row's position (the token it ran). ``inputs`` (when
    ``spec.sampled``): each row's temperature and random key (its uniform is drawn here, from the key and
    the row's length after this token, as :func:`nopad.inference.seeding.uniform_array` draws it), then
    with filters its top-k, top-p and min-p; last (with ``spec.penalty``) each row's seen-token mask and
    repetition penalty, which change what is drawn, not the raw or tempered log-probs (as there)."""
    z = logits.float()
    raw_lp = tempered_log_softmax(z)
    zp = z
    if spec.penalty:  # (the buffers hold at least the step's rows, padding included)
        *inputs, seen, penalty = inputs
        zp = penalize(z, seen[: z.shape[0]], penalty[: z.shape[0]])
    greedy_tokens = zp.argmax(dim=-1)
    top = raw_lp.topk(min(spec.top_n, z.shape[1]), dim=-1) if spec.top_n else None
    if not spec.sampled:
        raw = raw_lp.gather(1, greedy_tokens[:, None])[:, 0]
        return (greedy_tokens, raw, raw, torch.zeros_like(raw), *(top or ()))
    temperature, keys, *filters = inputs
    uniforms = uniform_tensor(keys, positions + 1)
    greedy = temperature == 0
    t = torch.where(greedy, 1.0, temperature).to(torch.float32)
    x = z / t[:, None]
    lt = torch.log_softmax(x, dim=-1)  # tempered, before any filter (what a trainer scores)
    if spec.penalty:  # what is drawn from: the penalised logits over the temperature
        x = zp / t[:, None]
    if filters:
        lp = _filtered_logprobs(x, greedy, spec, *filters)
    else:
        lp = torch.log_softmax(x, dim=-1) if spec.penalty else lt
    # inverse CDF, as sampler._inverse_cdf: exp in fp32, the running sum in float64
    cdf = torch.exp(lp).double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp(max=z.shape[1] - 1)
    tokens = torch.where(greedy, greedy_tokens, picked)
    raw = raw_lp.gather(1, tokens[:, None])[:, 0]
    at_t = lt.gather(1, tokens[:, None])[:, 0]
    tempered = torch.where(t == 1.0, raw, at_t)  # temperature 1 (and greedy rows): the raw log-prob
    sampling = torch.where(greedy, torch.zeros_like(at_t), lp.gather(1, tokens[:, None])[:, 0])
    return (tokens, raw, tempered, sampling, *(top or ()))


def _filtered_logprobs(
    x: torch.Tensor,
    greedy: torch.Tensor,
    spec: DrawSpec,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Log-probs of the tempered logits ``x`` after each row's top-k, top-p and min-p, as
    :func:`nopad.inference.sampling_filters.filtered_logprobs` computes them for the sampled rows (greedy
    rows come out unfiltered: their token is the argmax)."""
    vocab = x.shape[1]
    if spec.width:
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        tp = top_p.to(x.dtype) if spec.top_p else None
        kept = _kept(x, k, tp, min(spec.width, vocab), greedy, spec.full_sort)
        filtered = k < vocab if tp is None else (k < vocab) | (tp < 1.0)
        x = torch.where(filtered[:, None], kept, x)
    if spec.min_p:
        x = mask_min_p(x, min_p.to(x.dtype))
    return torch.log_softmax(x, dim=-1)


def _kept(
    x: torch.Tensor, k: torch.Tensor, tp: torch.Tensor | None, width: int, greedy: torch.Tensor, full_sort: bool
) -> torch.Tensor:
    """``x`` at -inf outside each row's top-k / top-p set, from ``width`` candidates; where the eager sampler
    would find some sampled row's top-p mass beyond them (its one host decision), from the whole sorted
    vocabulary instead, chosen on the device."""
    vocab = x.shape[1]
    vals, idx = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
    vals, probs = mask_top_k_top_p(x, vals, k, tp)
    kept = torch.full_like(x, float("-inf")).scatter(1, idx, vals)
    if not (full_sort and tp is not None and width < vocab):
        return kept
    all_vals, all_idx = x.sort(dim=-1, descending=True)
    all_vals, _ = mask_top_k_top_p(x, all_vals, k, tp)
    everything = torch.full_like(x, float("-inf")).scatter(1, all_idx, all_vals)
    sampled = ~greedy
    unbounded = (sampled & (tp < 1.0) & (k > width)).any()
    lacking = unbounded & (sampled & (probs.sum(dim=-1) < tp)).any()
    return torch.where(lacking, everything, kept)


def forward_and_draw(model: torch.nn.Module, spec: DrawSpec | None = None, inputs: tuple = (), **kwargs):
    """The compiled decode step: the model's forward on a static decode step's inputs (``kwargs``), then
    the logits of its rows, or given a ``spec`` the rows' draws (:func:`draw_rows` of ``inputs``). One
    function, so a step that draws inside the graph and one that returns logits share one ``torch.compile``."""
    logits = model(**kwargs).logits[0]
    return logits if spec is None else draw_rows(logits, spec, kwargs["position_ids"][0], *inputs)
