"""Token sampling for one step, vectorised over the batch, with counter-based randomness.

Randomness: each row is drawn by inverse-CDF sampling with ONE uniform number from
:func:`nopad.inference.seeding.uniform_draw` (a function of the request's seed, the sample's stream and
the position only), so the draw depends on nothing else in the batch, and a preempted sequence
redraws the same tokens when it is recomputed. The filters (temperature, top-k, top-p, min-p) are
:mod:`nopad.inference.sampling_filters`; the scratch memory, :mod:`nopad.inference.sampler_memory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from nopad.inference.penalties import SeenTokens, penalize_pairs, penalties_of, token_pairs
from nopad.inference.request import Sequence
from nopad.inference.sampler_memory import SamplerBuffers, host_tensor, log_softmax_into
from nopad.inference.sampling_filters import filtered_logprobs
from nopad.inference.sampling_rows import RowsPlan, plan_rows
from nopad.inference.seeding import uniform_draw
from nopad.packing.head.log_softmax import tempered_log_softmax


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[float]  # raw model log-prob of each sampled token
    temperature_logprobs: list[float]  # under softmax(logits / temperature), before any filter
    sampling_logprobs: list[float]  # log-prob under the processed distribution sampled from
    top_logprobs: list[dict[int, float] | None]
    policy_version: int = 0  # the weights whose logits these were (nopad.inference.Generator.policy_version)


class Sampler:
    """A generator's sampler: its reused buffers, and the policy version stamped on every draw
    (``version()``: the weights' current one, :class:`nopad.inference.weight_updates.PolicyVersions`)."""

    def __init__(self, version: Callable[[], int]):
        self.buffers, self.version = SamplerBuffers(), version

    def draw(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        ahead: int = 0,
        rows_plan: RowsPlan | None = None,
        uniforms: list[float] | None = None,
        penalties: SeenTokens | None = None,
    ) -> PendingSample:
        """:func:`sample_on_device` of every row of ``logits`` (overlap scheduling reads it back later)."""
        return sample_on_device(
            logits,
            seqs,
            self.buffers,
            policy_version=self.version(),
            ahead=ahead,
            rows_plan=rows_plan,
            uniforms=uniforms,
            penalties=penalties,
        )

    def sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> SampleResult:
        """Draw from the logits rows ``rows`` for ``seqs``, read back."""
        if rows != list(range(logits.shape[0])):
            logits = logits[host_tensor(rows, torch.long, logits.device)]
        return self.draw(logits, seqs).result()


def sample(
    logits: torch.Tensor, seqs: list[Sequence], buffers: SamplerBuffers | None = None, *, policy_version: int = 0
) -> SampleResult:
    """Draw one token per row of ``logits`` ``(rows, vocab)`` for ``seqs[row]``. ``buffers``
    (the generator's) lets the full-vocabulary temporaries reuse memory across steps;
    ``policy_version``: the weights whose logits these are, recorded with the tokens."""
    return sample_on_device(logits, seqs, buffers, policy_version=policy_version).result()


@dataclass
class PendingSample:
    """A step's draws still on the device: :meth:`result` reads them back (the step's one sync).

    Why: an overlapped step (:mod:`nopad.inference.overlap`) launches the next forward on these
    device tokens before the host needs them. On CUDA the results are copied into pinned host memory
    behind an event as soon as they are drawn, so reading them back waits for this step's sampler
    only, never for a forward queued after it."""

    tokens: torch.Tensor  # (rows,) int64, on the logits' device
    raw_picked: torch.Tensor  # raw log-prob of each sampled token
    temperature: torch.Tensor | None  # tempered log-probs; None: the raw ones
    sampling: torch.Tensor | None  # processed-distribution log-probs; None: greedy/untouched rows, 0
    top: list[tuple[torch.Tensor, torch.Tensor] | None]  # (values, ids) of the rows that asked
    policy_version: int = 0
    _host: tuple | None = None  # CUDA: the fields above, copied to pinned host memory behind _event
    _event: object = None

    def __post_init__(self) -> None:
        if _reads_back_async(self.tokens.device):  # (the device tokens stay: the next step's input ids)
            self._host = (
                _to_pinned_host(self.tokens),
                _to_pinned_host(self.raw_picked),
                None if self.temperature is None else _to_pinned_host(self.temperature),
                None if self.sampling is None else _to_pinned_host(self.sampling),
                [None if t is None else (_to_pinned_host(t[0]), _to_pinned_host(t[1])) for t in self.top],
            )
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampleResult:
        if self._host is None:
            return _read_back(
                self.tokens, self.raw_picked, self.temperature, self.sampling, self.top, self.policy_version
            )
        self._event.synchronize()
        return _read_back(*self._host, self.policy_version)


def _read_back(tokens, raw_picked, temperature, sampling, top_rows, policy_version: int) -> SampleResult:
    token_list = tokens.tolist()
    logprobs = raw_picked.tolist()
    top: list[dict[int, float] | None] = [None] * len(token_list)
    for i, t in enumerate(top_rows if any(top_rows) else ()):  # (no walk over rows that asked none)
        if t is not None:
            d = dict(zip(t[1].tolist(), t[0].tolist()))
            d.setdefault(token_list[i], logprobs[i])
            top[i] = d
    return SampleResult(
        tokens=token_list,
        logprobs=logprobs,
        temperature_logprobs=list(logprobs) if temperature is None else temperature.tolist(),
        sampling_logprobs=[0.0] * len(token_list) if sampling is None else sampling.tolist(),
        top_logprobs=top,
        policy_version=policy_version,
    )


def _reads_back_async(device: torch.device) -> bool:
    return device.type == "cuda"


def _to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def sample_on_device(
    logits: torch.Tensor,
    seqs: list[Sequence],
    buffers: SamplerBuffers | None = None,
    *,
    policy_version: int = 0,
    ahead: int = 0,
    rows_plan: RowsPlan | None = None,
    uniforms: list[float] | None = None,
    penalties: SeenTokens | None = None,
) -> PendingSample:
    """:func:`sample` up to the read-back. ``ahead``: tokens each sequence has drawn that are not in
    its ``token_ids`` yet (an overlapped step's, :mod:`nopad.inference.overlap`); its draw and
    ``min_tokens`` count them. Rows needing their full history on the host (repetition penalty)
    must have none ahead. ``rows_plan`` (:func:`plan_rows` of ``seqs``) and ``uniforms`` (each random
    row's :func:`uniform_draw`) may come from a batch that keeps them across steps, as may ``penalties``:
    every row's tokens so far and repetition penalty (:class:`nopad.inference.penalties.SeenTokens`)."""
    buffers = buffers if buffers is not None else SamplerBuffers()
    if logits.dtype != torch.float32:
        logits = buffers.get("logits", logits).copy_(logits)  # exact, as logits.float()
    raw_lp = log_softmax_into(logits, buffers, "raw_logprobs")
    rows, vocab = logits.shape
    rp = rows_plan if rows_plan is not None and rows_plan.vocab == vocab else plan_rows(seqs, vocab)
    params, greedy, rand, rand_params = rp.params, rp.greedy, rp.rand, rp.rand_params
    device = logits.device
    x = _adjusted(logits, seqs, rp, ahead, penalties)
    if len(greedy) == rows:  # no row copy of the (rows, vocab) logits
        tokens = argmax_rows(x)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=device)
    if greedy and rand:
        g = host_tensor(greedy, torch.long, device)
        tokens[g] = argmax_rows(x[g])
    sampling_lp = None
    if rand:
        sampling_lp = torch.zeros(rows, dtype=torch.float32, device=device)
        r = host_tensor(rand, torch.long, device)
        support = None  # every row's possible tokens, when filtering left each a few candidates
        if x is logits and len(rand) == rows and not rp.reshapes:
            lp = raw_lp  # temperature 1, nothing truncated: log_softmax(x / 1) is log_softmax(x)
        else:
            lp, support = filtered_logprobs(x if len(rand) == rows else x[r], rand_params, buffers)
        if uniforms is None:
            uniforms = [uniform_draw(seqs[i], ahead) for i in rand]
        picked = _inverse_cdf(lp, uniforms, buffers, support)
        tokens[r] = picked
        sampling_lp[r] = lp.gather(1, picked[:, None])[:, 0]
    top: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * rows
    for i in rp.top_rows:
        p = params[i]
        top[i] = raw_lp[i].topk(min(p.logprobs, vocab)) if p.logprobs else (raw_lp[i, :0], tokens[:0])
    raw_picked = raw_lp.gather(1, tokens[:, None])[:, 0]
    # greedy rows and rows at temperature 1 have their raw log-prob there and a sampling log-prob of
    # 0: said on the host, not by a tensor of copies or zeros read back (a sync each on CUDA)
    tempered = rp.tempered
    return PendingSample(
        tokens=tokens,
        raw_picked=raw_picked,
        temperature=_temperature_logprobs(logits, tokens, raw_picked, rand_params, rand, buffers) if tempered else None,
        sampling=sampling_lp,
        top=top,
        policy_version=policy_version,
    )


def _adjusted(
    logits: torch.Tensor, seqs: list[Sequence], rp: RowsPlan, ahead: int, penalties: SeenTokens | None
) -> torch.Tensor:
    """The logits rows draw from: repetition penalties (over prompt and output, as in vLLM/HF: a decode
    batch's kept tokens, else the penalised rows' tokens read on the host, :mod:`nopad.inference.penalties`)
    and ``min_tokens`` stop bans; ``logits`` itself when neither applies."""
    x, params = logits, rp.params
    if penalties is not None:
        x = penalties.apply(x)
    elif rp.penalized:
        assert not ahead, "a repetition penalty without kept tokens reads every token on the host"
        r = rp.penalized  # (the other rows' penalty is 1: their logits come out as they were)
        pairs = token_pairs([seqs[i] for i in r], logits.device, rows=r)
        x = penalize_pairs(x, pairs, penalties_of(params, logits.device))
    for i in rp.bans:  # plain attributes only (no property calls)
        seq, p = seqs[i], params[i]
        if seq.num_turn_tokens + ahead < p.min_tokens and seq.request.stop_ids:
            x = x.clone() if x is logits else x
            x[i, list(seq.request.stop_ids)] = float("-inf")
    return x


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of fp32 logits: the same indices (the first maximum; a NaN counts as the
    maximum), by numpy on CPU. Why: torch's CPU argmax over a vocabulary row is several times slower
    than numpy's (4.4 ms vs 0.57 ms for 64 x 49152 on one thread, ``benchmarks/bench_sampler.py``),
    and a greedy step pays it every step."""
    if x.device.type != "cpu" or x.requires_grad:
        return x.argmax(dim=-1)
    return torch.from_numpy(np.argmax(x.numpy(), axis=-1).astype(np.int64, copy=False))


def _temperature_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    raw_picked: torch.Tensor,
    rand_params: list,
    rand: list[int],
    buffers: SamplerBuffers,
) -> torch.Tensor:
    """Log-prob of each sampled token under ``softmax(logits / temperature)``: no penalty, no
    top-k/top-p/min-p truncation, i.e. what a trainer scoring the completion computes (TRL #6789).
    Computed by the trainer's own function (:func:`nopad.packing.head.log_softmax.tempered_log_softmax`), so
    under :func:`nopad.packing.batch_invariant` the bits match; ``T`` = 1 or greedy: the raw log-prob.
    ``rand_params`` are the parameters of the rows ``rand`` that are not greedy."""
    out = raw_picked.clone()
    for temperature in {p.temperature for p in rand_params if p.temperature != 1.0}:
        same = [i for i, p in zip(rand, rand_params) if p.temperature == temperature]
        rows = host_tensor(same, torch.long, logits.device)
        x = logits if len(same) == logits.shape[0] else logits[rows]
        lp = tempered_log_softmax(
            x,
            temperature,
            out=buffers.get("temperature_logprobs", x),
            tempered_out=buffers.get("temperature_logits", x),
        )
        out[rows] = lp.gather(1, tokens[rows][:, None])[:, 0]
    return out


def _inverse_cdf(
    logprobs: torch.Tensor, uniforms: list[float], buffers: SamplerBuffers, support: torch.Tensor | None = None
) -> torch.Tensor:
    """Token ``t`` with ``cdf[t-1] <= u * total < cdf[t]``: a draw from each row's distribution
    (zero-probability tokens are never picked). ``support``: each row's candidates (every other token
    has probability 0), whose CDF alone is walked (:func:`_inverse_cdf_over`): the same token."""
    if support is not None:
        return _inverse_cdf_over(logprobs, uniforms, support)
    # exp in fp32 (vectorised; float64's is slower, see benchmarks/bench_sampler.py), summed in
    # float64 so the CDF over the whole vocabulary keeps the tail's mass
    probs = torch.exp(logprobs, out=buffers.get("probs", logprobs))
    cdf = buffers.get("cdf", logprobs, torch.float64).copy_(probs).cumsum_(dim=-1)
    u = host_tensor(uniforms, torch.float64, logprobs.device) * cdf[:, -1]
    picked = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    return picked.clamp_(max=logprobs.shape[1] - 1)


def _inverse_cdf_over(logprobs: torch.Tensor, uniforms: list[float], support: torch.Tensor) -> torch.Tensor:
    """:func:`_inverse_cdf` walking only each row's candidates ``support`` ``(rows, width)``, in vocabulary
    order. Why the same token, bit for bit: every other token's probability is exactly 0, and adding 0
    to a float64 running sum (the CDF is summed one token after another) changes nothing, so the
    candidates' CDF values are the whole vocabulary's at those tokens, and the first CDF value above
    ``u`` is a candidate's. A top-p step keeps a few of 49k tokens: this walks ``width`` (1,024) of them."""
    cols = support.sort(dim=-1).values
    cdf = torch.exp(logprobs.gather(1, cols)).double().cumsum_(dim=-1)
    total = cdf[:, -1]
    u = host_tensor(uniforms, torch.float64, logprobs.device) * total
    picked = torch.searchsorted(cdf, u[:, None], right=True)[:, 0]
    last = (cdf < total[:, None]).sum(dim=-1)  # the last candidate with mass (u rounded up to the total)
    return cols.gather(1, torch.minimum(picked, last)[:, None])[:, 0]
