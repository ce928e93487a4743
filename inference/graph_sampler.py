"""The decode step's sampler inside its compiled graph: the forward, the draw and the log-probs as one
graph, so a steady decode step launches one CUDA graph and no sampler kernel after it.

Why: with ``compile_decode`` on CUDA the forward is one graph replay, and the eager sampler after it
(log-softmax, argmax, gather, and for sampled rows the tempered log-softmax, the CDF and its search) was
a dozen more launches on the step's critical path. Inside the graph they are fused and replayed.

What it serves: rows that are greedy or sampled at a temperature alone (no top-k, top-p or min-p, no
top log-probs) -- what evaluation and RL rollouts run. A decode batch with any other row samples after
the graph, as before (:func:`nopad.inference.sampler.sample_on_device`). The draw is the eager sampler's,
op for op (:func:`draw_rows`): the same counter-based uniforms (computed on the host from each row's key
and length, :mod:`nopad.inference.seeding`, and sent with the step's inputs), the same inverse CDF and the
same log-prob expressions; under dynamo's eager backend the tokens and log-probs are the eager sampler's
bit for bit (the tests hold it), and compiled they are the compiled kernels' values of the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nopad.inference.sampler import PendingSample
from nopad.packing.head.log_softmax import tempered_log_softmax


def served(params: list) -> bool:
    """Whether every row's parameters are drawn inside the graph: greedy, or a temperature alone."""
    return all(
        [
            p.logprobs is None and (p.temperature == 0 or (p.top_k in (0, -1) and p.top_p == 1.0 and p.min_p == 0.0))
            for p in params
        ]
    )


@dataclass
class GraphDraw:
    """A steady decode step's sampling inputs, for the graph: each row's temperature (0: greedy) and its
    uniform number (0 for greedy rows), host arrays sent with the step's other inputs."""

    temperature: np.ndarray  # (rows,) float64
    uniforms: np.ndarray | None  # (rows,) float64; None: every row is greedy
    tempered: bool  # some row's temperature is neither 0 nor 1: its tempered log-prob is its own
    policy_version: int

    def pending(self, outputs: tuple[torch.Tensor, ...], num: int) -> PendingSample:
        """The graph's outputs for the first ``num`` rows (the rest are padding), as the eager sampler
        returns them: no tempered log-probs when no row's temperature changes them, no sampling
        log-probs when every row is greedy."""
        tokens, raw, tempered, sampling = (t[:num] for t in outputs)
        greedy = self.uniforms is None
        return PendingSample(
            tokens=tokens,
            raw_picked=raw,
            temperature=tempered if self.tempered and not greedy else None,
            sampling=None if greedy else sampling,
            top=[None] * num,
            policy_version=self.policy_version,
        )


def draw_rows(
    logits: torch.Tensor, temperature: torch.Tensor | None, uniforms: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's token, its raw log-prob, its log-prob at the row's temperature, and its log-prob under
    the distribution it was drawn from (0 for greedy rows): the eager sampler's expressions
    (:func:`nopad.inference.sampler.sample_on_device` for rows without filters), with no host decision.
    ``temperature`` ``None``: every row is greedy (argmax and the raw log-prob only)."""
    z = logits.float()
    raw_lp = tempered_log_softmax(z)
    greedy_tokens = z.argmax(dim=-1)
    if temperature is None:
        raw = raw_lp.gather(1, greedy_tokens[:, None])[:, 0]
        return greedy_tokens, raw, raw, torch.zeros_like(raw)
    greedy = temperature == 0
    t = torch.where(greedy, 1.0, temperature).to(torch.float32)
    lp = torch.log_softmax(z / t[:, None], dim=-1)
    # inverse CDF, as sampler._inverse_cdf: exp in fp32, the running sum in float64
    cdf = torch.exp(lp).double().cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0]
    picked = picked.clamp(max=z.shape[1] - 1)
    tokens = torch.where(greedy, greedy_tokens, picked)
    raw = raw_lp.gather(1, tokens[:, None])[:, 0]
    at_t = lp.gather(1, tokens[:, None])[:, 0]
    tempered = torch.where(t == 1.0, raw, at_t)  # temperature 1 (and greedy rows): the raw log-prob
    sampling = torch.where(greedy, torch.zeros_like(at_t), at_t)
    return tokens, raw, tempered, sampling


def forward_and_draw(
    model: torch.nn.Module,
    temperature: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    draw: bool = False,
    **kwargs,
):
    """The compiled decode step: the model's forward on a static decode step's inputs (``kwargs``), then
    the logits of its rows, or with ``draw`` the rows' draws (:func:`draw_rows`). One function, so a step
    that draws inside the graph and one that returns logits share one ``torch.compile``."""
    logits = model(**kwargs).logits[0]
    return draw_rows(logits, temperature, uniforms) if draw else logits
