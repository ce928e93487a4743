"""Tests of SamplingParams validation and the sampler's maths and counter-based randomness."""

from __future__ import annotations

import math
import random

import pytest
import torch

from nopad.inference import Generator
from nopad.inference.request import Request, Sequence
from nopad.inference.sampler import sample
from nopad.inference.sampling_filters import processed_logprobs
from nopad.inference.sampling_params import SamplingParams
from nopad.inference.seeding import counter_seed
from tests.support.models import tiny_model


def seq_with(params: SamplingParams, tokens=(5, 6), index=0, seed=0, stop_ids=frozenset({2})):
    request = Request("r", None, list(tokens), params, seed, 0.0, frozenset(stop_ids))
    return Sequence(request=request, index=index, token_ids=list(tokens))


def test_defaults_and_normalisation():
    p = SamplingParams(stop="x", stop_token_ids=(7,))
    assert p.stop == ["x"] and p.stop_token_ids == [7] and p.n == 1 and p.max_tokens == 16
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0"),
        ({"top_p": 0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.01}, "top_p must be in (0, 1]"),
        ({"min_p": -0.5}, "min_p must be in [0, 1]"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"n": 0}, "n must be >= 1, got 0"),
        ({"n": True}, "n must be an int"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must be <= max_tokens (4)"),
        ({"stop": 3}, "stop must be a string or a list of strings, got int"),
        ({"stop": ["a", 3]}, "stop must be a string or a list of strings"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of non-negative ints"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"seed": "7"}, "seed must be an int"),
    ],
)
def test_invalid_params(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def random_keys(count: int = 20_000):
    """uint64 stream keys (the extremes among them) and lengths up to 2**40 (some 0, some past 2**62)."""
    import numpy as np

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**64, size=count, dtype=np.uint64)
    keys[:5] = [0, 2**64 - 1, 2**63, 2**63 - 1, 1]
    lengths = rng.integers(0, 2**40, size=count, dtype=np.int64)
    lengths[:5] = [0, 1, 2**62, 7, 2**63 - 1]
    return keys, lengths


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "dynamo"])
def test_the_device_uniforms_are_the_hosts_bit_for_bit(compiled):
    """``uniform_tensor`` (the compiled step's draw, int64 ops standing in for uint64's) gives every row the
    float64 ``uniform_array`` (numpy's uint64 splitmix) gives it: a graph-drawn row and an eager-drawn one
    draw the same token at the same position, whichever path a step takes."""
    from nopad.inference.seeding import uniform_array, uniform_tensor

    keys, lengths = random_keys()
    fn = torch.compile(uniform_tensor, backend="eager", dynamic=True) if compiled else uniform_tensor
    got = fn(torch.from_numpy(keys.view("int64")), torch.from_numpy(lengths))
    assert got.dtype == torch.float64 and got.tolist() == uniform_array(keys, lengths).tolist()


def test_counter_seed_depends_on_every_key():
    base = counter_seed(1, 0, 10)
    assert base == counter_seed(1, 0, 10)
    assert len({base, counter_seed(2, 0, 10), counter_seed(1, 1, 10), counter_seed(1, 0, 11)}) == 4
    assert 0 <= base < 2**63


def test_processed_logprobs_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def keep(**kw):
        return torch.isfinite(processed_logprobs(logits, [SamplingParams(**kw)]))[0].tolist()

    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.79) == [True, True, False, False]  # 0.5 + 0.3 covers 0.79
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(top_p=0.1) == [True, False, False, False]
    assert keep(min_p=0.4) == [True, True, False, False]  # below 0.4 * 0.5 = 0.2 dropped
    assert keep(min_p=0.25) == [True, True, True, False]
    lp = processed_logprobs(logits, [SamplingParams(temperature=0.5, top_k=2)])[0]
    expected = torch.log_softmax(torch.log(torch.tensor([0.5, 0.3])) / 0.5, dim=0)
    torch.testing.assert_close(lp[:2], expected)


def reference_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep-mask by sorting the whole vocabulary (the textbook definition)."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep_sorted = (sorted_probs.cumsum(0) - sorted_probs) < top_p
    return torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0])  # flat (needs the full-sort fallback) .. peaked
def test_top_p_on_a_large_vocabulary_matches_a_full_sort(scale):
    torch.manual_seed(1)
    logits = torch.randn(3, 5000) * scale
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5, top_k=3000), SamplingParams()]
    lp = processed_logprobs(logits, params)
    assert torch.equal(torch.isfinite(lp[0]), reference_top_p(logits[0], 0.9))
    top3000 = logits[1].masked_fill(logits[1] < logits[1].topk(3000).values[-1], float("-inf"))
    assert torch.equal(torch.isfinite(lp[1]), reference_top_p(top3000, 0.5))
    torch.testing.assert_close(lp[2], torch.log_softmax(logits[2], dim=0))
    kept = torch.isfinite(lp[0])
    torch.testing.assert_close(lp[0][kept], torch.log_softmax(logits[0][kept], dim=0))


class DeviceQuestions(torch.overrides.TorchFunctionMode):
    """Counts the host's questions to a tensor (``bool(t)``, ``t.item()``): each a sync on CUDA."""

    def __init__(self):
        super().__init__()
        self.asked = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.asked += getattr(func, "__name__", "") in ("__bool__", "item")
        return func(*args, **(kwargs or {}))


def test_a_top_p_row_with_its_own_top_k_asks_the_device_nothing():
    """Whether the top-p candidates hold a row's mass was asked of the device every step (a sync on CUDA,
    which stalled an overlapped step's launch); a row whose top-k is among the candidates cuts its top-p
    inside them, so only a top-p row without top-k asks. Flat logits: the fallback's own case."""
    torch.manual_seed(2)
    logits = torch.randn(3, 5000) * 0.01
    bounded = [SamplingParams(top_p=0.9, top_k=50), SamplingParams(top_p=0.5, top_k=2000), SamplingParams()]
    with DeviceQuestions() as mode:
        lp = processed_logprobs(logits, bounded)
    assert mode.asked == 0
    for row, (p, k) in enumerate([(0.9, 50), (0.5, 2000)]):
        top = logits[row].masked_fill(logits[row] < logits[row].topk(k).values[-1], float("-inf"))
        assert torch.equal(torch.isfinite(lp[row]), reference_top_p(top, p))
    with DeviceQuestions() as mode:
        lp = processed_logprobs(logits, [SamplingParams(top_p=0.9), *bounded[1:]])
    assert mode.asked == 1
    assert torch.equal(torch.isfinite(lp[0]), reference_top_p(logits[0], 0.9))


def test_sample_greedy_penalty_and_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0], [0.0, 1.0, 3.0, 2.0]])
    seqs = [
        seq_with(SamplingParams(temperature=0)),
        seq_with(SamplingParams(temperature=0, min_tokens=1)),  # token 2 is a stop id: banned
        seq_with(SamplingParams(temperature=0, repetition_penalty=4.0), tokens=(3,)),  # 2.0 -> 0.5
    ]
    out = sample(logits, seqs)
    assert out.tokens == [2, 3, 2]
    raw = torch.log_softmax(logits[0], dim=0)
    assert out.logprobs == pytest.approx([raw[2].item(), raw[3].item(), raw[2].item()])
    assert out.sampling_logprobs == [0.0, 0.0, 0.0]
    assert out.top_logprobs == [None, None, None]


def test_sample_is_counter_based():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    params = SamplingParams(temperature=1.0, logprobs=2)
    a = sample(logits, [seq_with(params, seed=11)])
    b = sample(torch.cat([torch.randn(3, 50), logits]), [seq_with(params, seed=s) for s in (1, 2, 3, 11)])
    assert a.tokens[0] == b.tokens[3] and a.sampling_logprobs[0] == pytest.approx(b.sampling_logprobs[3])
    draws = {sample(logits, [seq_with(params, seed=s)]).tokens[0] for s in range(40)}
    assert len(draws) > 5  # different seeds draw different tokens
    assert len(a.top_logprobs[0]) in (2, 3) and a.tokens[0] in a.top_logprobs[0]


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log()[None]
    params = SamplingParams(temperature=1.0)
    tokens = sample(logits.expand(3000, 3), [seq_with(params, seed=s) for s in range(3000)]).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float()
    torch.testing.assert_close(counts / 3000, probs, atol=0.03, rtol=0)


def test_temperature_logprobs_are_untruncated_and_the_trainers_expression():
    """TRL #6789: the log-prob a trainer scores is log_softmax(logits / T), before top-k/top-p/
    min-p truncation and penalties; the sampler returns exactly that (bitwise: the same expression)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 64) * 3
    params = [
        SamplingParams(temperature=0.7, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
        SamplingParams(temperature=1.3, repetition_penalty=1.2),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    out = sample(logits, [seq_with(p, seed=i) for i, p in enumerate(params)])
    tokens = torch.tensor(out.tokens)
    for i, p in enumerate(params):
        trainer = torch.log_softmax(logits[i : i + 1].float() / p.temperature, dim=-1)[0, tokens[i]]
        assert torch.equal(torch.tensor(out.temperature_logprobs[i]), trainer)
    assert out.temperature_logprobs[3] == out.logprobs[3]  # T = 1: the raw log-prob
    # the truncated distributions put more mass on the kept tokens: a different (biased) number
    for i in (0, 1, 3):
        assert out.sampling_logprobs[i] > out.temperature_logprobs[i] + 1e-3


def _mixed_seqs(rows: int, offset: int = 0):
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.1, logprobs=3),
    ]
    return [seq_with(kinds[(i + offset) % len(kinds)], tokens=(5, 6, 7 + i), seed=i + offset) for i in range(rows)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reused_sampler_buffers_give_what_fresh_ones_give(dtype):
    """The generator reuses the sampler's rows x vocab buffers across steps (no page faults each
    step); steps of other sizes and parameter mixes must still get exactly what fresh memory gives."""
    from nopad.inference.sampler_memory import SamplerBuffers

    torch.manual_seed(3)
    buffers = SamplerBuffers()
    steps = [
        (9, 0, None),
        (4, 2, None),
        (13, 1, None),
        (6, 0, SamplingParams(temperature=0.9, top_p=0.8)),
        (5, 0, SamplingParams(temperature=1.0)),
        (9, 0, None),  # a shape seen before the buffers grew: its kept view must be of the new memory
        (9, 3, None),  # the same shape twice in a row: the kept views (a steady decode's case)
    ]
    for rows, offset, same in steps:  # mixed params, then all rows filtered, then all rows unfiltered
        logits = (torch.randn(rows, 3000) * 4).to(dtype)
        seqs = _mixed_seqs(rows, offset) if same is None else [seq_with(same, seed=i) for i in range(rows)]
        got = sample(logits, seqs, buffers)
        fresh = sample(logits, seqs)
        for field in ("tokens", "logprobs", "temperature_logprobs", "sampling_logprobs", "top_logprobs"):
            assert getattr(got, field) == getattr(fresh, field), field
        raw = torch.log_softmax(logits.float(), dim=-1)  # the trainer's expression, bitwise
        assert got.logprobs == raw.gather(1, torch.tensor(got.tokens)[:, None])[:, 0].tolist()
    first = buffers.get("raw_logprobs", torch.empty(13, 3000)).data_ptr()
    sample(torch.randn(8, 3000).to(dtype), _mixed_seqs(8), buffers)
    assert buffers.get("raw_logprobs", torch.empty(8, 3000)).data_ptr() == first  # reused, not reallocated


def test_processed_logprobs_leave_their_input_alone():
    torch.manual_seed(0)
    x = torch.randn(3, 500)
    before = x.clone()
    processed_logprobs(x, [SamplingParams(top_p=0.5), SamplingParams(top_k=3, min_p=0.1), SamplingParams()])
    assert torch.equal(x, before)


def test_top_logprobs_above_the_generators_cap_are_refused_as_vllm_does():
    """logprobs=10**6 used to return whole-vocabulary dicts at every position (a memory trap at
    150k vocabularies); like vLLM's max_logprobs (default 20) the Generator caps them."""
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=16)
    for name, k in (("logprobs", 10**6), ("prompt_logprobs", 21)):
        message = (
            rf"{name}={k} is more than the Generator's max_logprobs=20 \(each position would hold a "
            rf"dict of {k} tokens\); ask for at most 20, or raise the cap: Generator\(\.\.\., "
            rf"max_logprobs={k}\)"
        )
        with pytest.raises(ValueError, match="prompt 0: " + message):
            gen.generate([[5, 6, 7]], SamplingParams(max_tokens=2, **{name: k}), use_tqdm=False)
        with pytest.raises(ValueError, match=message):
            gen.add_request([5, 6, 7], SamplingParams(max_tokens=2, **{name: k}))
    assert not gen.has_unfinished()
    wide = Generator(model, block_size=4, num_blocks=16, max_logprobs=50)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=50, prompt_logprobs=50)
    out = wide.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert [len(top) for top in out.outputs[0].top_logprobs] == [50, 50]
    assert len(out.prompt_logprobs[1]) in (50, 51)  # the prompt token, if not among the top 50
    with pytest.raises(ValueError, match="max_logprobs must be an int >= 0"):
        Generator(model, block_size=4, num_blocks=16, max_logprobs=-1)


@pytest.mark.parametrize("kind", ["top_p", "top_k", "top_k_top_p", "top_p_min_p"])
def test_the_draw_over_the_candidates_is_the_draw_over_the_vocabulary(kind):
    """When every row was filtered, the inverse CDF walks only the candidates (in vocabulary order):
    the same token as walking the whole vocabulary, for random uniforms and for uniforms placed at
    the CDF's own steps (the exact boundaries, where a different running sum would show)."""
    from nopad.inference.sampler import _inverse_cdf
    from nopad.inference.sampler_memory import SamplerBuffers
    from nopad.inference.sampling_filters import filtered_logprobs

    rng = random.Random(kind)
    gen = torch.Generator().manual_seed(len(kind))
    walked = 0
    for vocab in (2053, 4099, 6000):
        rows = 5
        x = torch.randn(rows, vocab, generator=gen) * rng.choice([4.0, 8.0])
        params = [
            SamplingParams(
                temperature=rng.choice([0.5, 1.0, 1.3]),
                top_p=rng.choice([0.6, 0.95]) if "top_p" in kind else 1.0,
                top_k=rng.choice([3, 40]) if "top_k" in kind else 0,
                min_p=0.05 if "min_p" in kind else 0.0,
            )
            for _ in range(rows)
        ]
        buffers = SamplerBuffers()
        lp, support = filtered_logprobs(x, params, buffers)
        if support is None:  # the candidates could not hold a row's top-p mass: the whole vocabulary was sorted
            continue
        walked += 1
        cdf = torch.exp(lp).double().cumsum(dim=-1)
        draws = [[rng.random() for _ in range(rows)] for _ in range(30)]
        for _ in range(30):  # at the steps of each row's CDF (below its total)
            steps = [torch.nonzero((c > 0) & (c < c[-1]))[:, 0] for c in cdf]
            draws.append([(c[s[rng.randrange(len(s))]] / c[-1]).item() if len(s) else 0.5 for c, s in zip(cdf, steps)])
        for u in draws:
            whole = _inverse_cdf(lp, u, buffers)
            assert torch.equal(_inverse_cdf(lp, u, buffers, support), whole), (vocab, u)
            assert torch.isfinite(lp.gather(1, whole[:, None])).all()  # never a zero-probability token
    assert walked >= 2
