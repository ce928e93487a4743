"""The distribution a sampled row draws from: its logits over the temperature, then top-k and top-p on a
candidate set from ``topk`` (falling back to a full sort only when the candidates cannot hold a row's
top-p mass), then min-p. Exact, and much cheaper than sorting the vocabulary every step. When every
row was filtered, the candidates are returned too: the draw then walks their CDF alone, not the
vocabulary's (:func:`nopad.inference.sampler.sample_on_device`)."""

from __future__ import annotations

import torch

from nopad.inference.sampler_memory import SamplerBuffers, host_tensor, log_softmax_into


def processed_logprobs(x: torch.Tensor, params: list, buffers: SamplerBuffers | None = None) -> torch.Tensor:
    """Log-probs after temperature, top-k, top-p and min-p (rows of ``x`` are logits; ``x`` itself
    is not modified)."""
    return filtered_logprobs(x, params, buffers)[0]


def filtered_logprobs(
    x: torch.Tensor, params: list, buffers: SamplerBuffers | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`processed_logprobs`, and each row's candidates ``(rows, width)`` when every row was
    filtered from ``width`` < vocab of them (every token outside has log-prob -inf; else None)."""
    buffers = buffers if buffers is not None else SamplerBuffers()
    support = None
    rows, vocab = x.shape
    temp = host_tensor([p.temperature for p in params], x.dtype, x.device)
    x = torch.div(x, temp[:, None], out=buffers.get("tempered", x))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [float(p.top_p) for p in params]
    filtered = [k < vocab or tp < 1.0 for k, tp in zip(top_k, top_p)]
    if any(filtered):
        kept = _top_k_top_p(x, top_k, top_p, _candidates(top_k, top_p, vocab))
        if kept is None:  # the candidates hold less than top_p of the mass: sort everything
            kept = _top_k_top_p(x, top_k, top_p, vocab)
        idx, vals = kept
        if all(filtered):  # every row keeps only its candidates: write them over x in place
            x.fill_(float("-inf")).scatter_(1, idx, vals)
            support = idx if idx.shape[1] < vocab else None
        else:
            full = buffers.get("kept", x).fill_(float("-inf")).scatter_(1, idx, vals)
            x = torch.where(host_tensor(filtered, torch.bool, x.device)[:, None], full, x, out=x)
    if any(p.min_p > 0 for p in params):
        x = mask_min_p(x, host_tensor([float(p.min_p) for p in params], x.dtype, x.device))
    return log_softmax_into(x, buffers, "logprobs"), support


TOP_P_CANDIDATES = 1024


def _candidates(top_k: list[int], top_p: list[float], vocab: int) -> int:
    width = max([k for k in top_k if k < vocab], default=0)
    if any(p < 1.0 for p in top_p):
        width = max(width, TOP_P_CANDIDATES)
    return min(width, vocab)


def _top_k_top_p(
    x: torch.Tensor, top_k: list[int], top_p: list[float], width: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(indices, values)`` of each row's ``width`` most likely tokens, the values at -inf outside
    the row's top-k / top-p set (everything else is dropped); None if those candidates cannot hold
    some row's top-p mass."""
    vocab = x.shape[1]
    vals, idx = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
    k = host_tensor(top_k, torch.long, x.device)
    tp = host_tensor(top_p, x.dtype, x.device) if any(p < 1.0 for p in top_p) else None
    vals, probs = mask_top_k_top_p(x, vals, k, tp)
    # only a row without its own top-k within the candidates can lack top_p of the mass among them
    # (a row's top-k set is all in them, and its top-p is cut inside it): asked only then, since the
    # question reads the device back, a sync on CUDA every step (top_k=50 with top_p=0.9 asks none)
    unbounded = any(row_p < 1.0 and row_k > width for row_k, row_p in zip(top_k, top_p))
    if width < vocab and unbounded and bool((probs.sum(dim=-1) < tp).any()):
        return None
    return idx, vals


def mask_top_k_top_p(
    x: torch.Tensor, vals: torch.Tensor, k: torch.Tensor, tp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``vals``, each row's most likely values of ``x`` in descending order, at -inf outside the row's
    top ``k`` and, given ``tp``, its top-p set; and the candidates' probabilities the top-p cut read (None
    without ``tp``). Device ops only: the eager sampler and the compiled step's draw
    (:mod:`nopad.inference.graph_sampler`) share it, so their bits agree."""
    width, vocab = vals.shape[1], x.shape[1]
    vals = vals.masked_fill(torch.arange(width, device=x.device)[None, :] >= k[:, None], float("-inf"))
    if tp is None:
        return vals, None
    # probabilities under the top-k-filtered FULL distribution (rows without top-k keep the mass of the
    # tokens beyond the candidates in their normaliser)
    norm = torch.where(k < vocab, torch.logsumexp(vals, dim=-1), torch.logsumexp(x, dim=-1))
    probs = torch.exp(vals - norm[:, None])
    before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
    return vals.masked_fill(before >= tp[:, None], float("-inf")), probs


def mask_min_p(x: torch.Tensor, mp: torch.Tensor) -> torch.Tensor:
    """``x`` (in place) at -inf where a token's probability is under ``mp`` times its row's largest."""
    probs = torch.softmax(x, dim=-1)
    return x.masked_fill_(probs < mp[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
