"""A steady decode step drawn inside its compiled graph (:mod:`nopad.inference.graph_sampler`): the same
tokens and log-probs as the eager sampler after the graph, bit for bit under dynamo's eager backend
(the graph's ops are then the eager kernels), one graph per variant (no graph break), and the rows it
filters (top-k, top-p, min-p) and top log-probs drawn there too. On CPU the draw stays outside the
graph by default (``ModelRunner.graph_draws``, on for CUDA); these tests turn it on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.inference.graph_sampler import DrawSpec
from nopad.packing import batch_invariant
from tests.inference.test_inference_hybrid import hybrid_model
from tests.support.models import SERVING_CASES, serving_case, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")

PROMPTS = [[5 + i, 9, 2 + 3 * i, 7][: 2 + i % 3] for i in range(7)]


def mixed_params(**extra) -> list[SamplingParams]:
    """Greedy rows, rows at temperatures 0.7, 1 and 1.3 (seeded, one with n = 2), a stop id, lengths that
    drop rows out of the batch one by one."""
    return [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=12, ignore_eos=True, **extra),
        SamplingParams(temperature=1.0, seed=4, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=1.3, seed=5, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(temperature=0.9, seed=6, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]


@pytest.fixture
def eager_dynamo(monkeypatch):
    """torch.compile with dynamo's eager backend: dynamo's graphs and guards, the eager kernels (bitwise
    comparable; an inductor compile takes minutes on a shared CPU)."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: compile_(fn, backend="eager", **kw))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def generate(model, params, draws: bool, **kwargs):
    gen = Generator(model, block_size=4, max_num_batched_tokens=64, compile_decode=True, **kwargs)
    gen._ensure_runner().graph_draws = draws
    return gen.generate(PROMPTS[: len(params)], params, use_tqdm=False), gen


def records(outs) -> list[tuple]:
    """Every completion's tokens, log-probs (raw, tempered, sampling), versions and finish reason."""
    return [
        (c.token_ids, c.logprobs, c.temperature_logprobs, c.sampling_logprobs, c.policy_versions, c.finish_reason)
        for out in outs
        for c in out.outputs
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_graph_draws_equal_the_eager_sampler(eager_dynamo, overlap):
    """Greedy and tempered rows (n > 1, a stop id, rows ending one by one): the graph's draws are the eager
    sampler's, tokens and all three log-probs bit for bit, serial and overlapped; and they were drawn
    there (the decode batch's steps counted)."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    drawn, gen = generate(model, mixed_params(), True, overlap=overlap)
    stats = gen.stats()
    assert 0 < stats["graph_draw_steps"] == stats["decode_batch_steps"]
    # one graph per variant the step ran (logits for the general step's decodes, sampled draws), no break
    variants = {spec for _, spec in gen._runner._variants}
    assert any(spec is not None and spec.sampled for spec in variants)
    assert counters["stats"]["unique_graphs"] - graphs == len(variants)
    assert sum(counters["graph_break"].values()) == breaks
    eager, gen = generate(model, mixed_params(), False, overlap=overlap)
    assert gen.stats()["graph_draw_steps"] == 0 < gen.stats()["decode_batch_steps"]
    assert records(drawn) == records(eager)
    tempered = [c.temperature_logprobs != c.logprobs for out in drawn for c in out.outputs]
    assert any(tempered)  # the 0.7 / 1.3 rows' tempered log-probs are their own


def test_all_greedy_steps_draw_argmax_in_the_graph(eager_dynamo):
    """Every row greedy: the graph's argmax variant (no CDF), the eager sampler's tokens and log-probs."""
    model = tiny_model("qwen3")
    params = [SamplingParams(temperature=0.0, max_tokens=6 + i, ignore_eos=True) for i in range(5)]
    drawn, gen = generate(model, params, True)
    assert gen.stats()["graph_draw_steps"] > 0
    assert DrawSpec() in {spec for _, spec in gen._runner._variants}
    eager, _ = generate(model, params, False)
    assert records(drawn) == records(eager)
    assert all(c.sampling_logprobs == [0.0] * len(c.token_ids) for out in drawn for c in out.outputs)


def test_greedy_rows_with_repetition_penalties_draw_in_the_graph(eager_dynamo):
    """Every row greedy, some penalised: the argmax variant over the penalised logits (the mask and the
    penalties are the graph's inputs), the eager sampler's tokens, one graph per spec whatever the rows;
    the penalty changed them."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3")
    params = [SamplingParams(temperature=0.0, max_tokens=8 + i, ignore_eos=True) for i in range(4)]
    params[1:3] = [dataclasses.replace(p, repetition_penalty=1.7) for p in params[1:3]]
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    drawn, gen = generate(model, params, True)
    assert DrawSpec(penalty=True) in {spec for _, spec in gen._runner._variants}
    # one graph per spec, whatever the rows (the mask is read whole, from its static buffer), no break
    assert counters["stats"]["unique_graphs"] - graphs == len({spec for _, spec in gen._runner._variants})
    assert sum(counters["graph_break"].values()) == breaks
    assert 0 < gen.stats()["graph_draw_steps"] == gen.stats()["decode_batch_steps"]
    eager, _ = generate(model, params, False)
    assert records(drawn) == records(eager)
    plain, _ = generate(model, [dataclasses.replace(p, repetition_penalty=1.0) for p in params], True)
    assert [r[0] for r in records(plain)][1:3] != [r[0] for r in records(drawn)][1:3]


FILTERS = {
    "top_p": dict(top_p=0.8),
    "top_k": dict(top_k=3),
    "min_p": dict(min_p=0.5),
    "top_logprobs": dict(logprobs=2),
    "top_k_and_top_p": dict(top_k=5, top_p=0.7),
    "everything": dict(top_k=40, top_p=0.9, min_p=0.02, logprobs=3, repetition_penalty=1.2),
}


@pytest.mark.parametrize("extra", FILTERS.values(), ids=FILTERS.keys())
@pytest.mark.parametrize("overlap", [False, True])
def test_filtered_rows_are_drawn_in_the_graph(eager_dynamo, extra, overlap):
    """A batch with top-p, top-k, min-p, top-log-probs or repetition-penalty rows (beside greedy and
    tempered ones) is drawn inside the graph too: the eager sampler's tokens, log-probs and top log-probs,
    bit for bit."""
    model = tiny_model("llama")
    params = mixed_params(**extra)
    if "logprobs" in extra:  # rows asking for different counts, a greedy one for none but its token's
        params[0] = dataclasses.replace(params[0], logprobs=0)
        params[3] = dataclasses.replace(params[3], logprobs=extra["logprobs"] + 2)
    if "repetition_penalty" in extra:  # a greedy row's penalty below 1 (its seen tokens favoured)
        params[0] = dataclasses.replace(params[0], repetition_penalty=0.6)
    drawn, gen = generate(model, params, True, overlap=overlap)
    assert 0 < gen.stats()["graph_draw_steps"] == gen.stats()["decode_batch_steps"]
    penalised = [spec.penalty for _, spec in gen._runner._variants if spec is not None]
    assert any(penalised) == ("repetition_penalty" in extra)
    eager, _ = generate(model, params, False, overlap=overlap)
    assert records(drawn) == records(eager)
    assert tops(drawn) == tops(eager)
    if "logprobs" in extra:
        assert any(top is not None for out in drawn for c in out.outputs for top in c.top_logprobs or ())


def tops(outs) -> list:
    return [c.top_logprobs for out in outs for c in out.outputs]


@pytest.mark.parametrize("top_p", [0.97, 0.05], ids=["beyond_the_candidates", "within_them"])
def test_top_p_over_a_vocabulary_larger_than_its_candidates(eager_dynamo, top_p):
    """A 4,096-token vocabulary, more than the 1,024 top-p candidates: at top-p 0.97 on a random model's flat
    distribution the candidates lack the mass and the eager sampler sorts the vocabulary (the graph picks
    that branch on the device); at 0.05 they hold it. A top-k row rides along (its top-p is bounded)."""
    model = tiny_model("llama", vocab_size=4096)
    params = [
        SamplingParams(temperature=0.9, top_p=top_p, seed=1, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=top_p, top_k=50, seed=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    drawn, gen = generate(model, params, True)
    assert gen.stats()["graph_draw_steps"] > 0
    assert {spec.full_sort for _, spec in gen._runner._variants if spec is not None} == {True}
    eager, _ = generate(model, params, False)
    assert records(drawn) == records(eager)


@pytest.mark.parametrize("extra", [{}, FILTERS["everything"]], ids=["temperatures", "filters"])
@pytest.mark.parametrize("overlap", [False, True])
def test_hybrid_state_slots_with_graph_draws(eager_dynamo, overlap, extra):
    """A Mamba2 hybrid's rows keep their state slots when the graph draws them, serial and overlapped,
    filtered rows too."""
    model = hybrid_model("bamba")
    params = mixed_params(**extra)[:4]
    drawn, gen = generate(model, params, True, max_num_seqs=3, overlap=overlap)
    assert gen.stats()["graph_draw_steps"] > 0
    eager, _ = generate(model, params, False, max_num_seqs=3, overlap=overlap)
    assert records(drawn) == records(eager)
    assert tops(drawn) == tops(eager)


@pytest.mark.parametrize("extra", [{}, FILTERS["everything"]], ids=["temperatures", "filters"])
@pytest.mark.parametrize("case", SERVING_CASES)
def test_sinks_a_large_vocabulary_and_bf16_draw_in_the_graph(eager_dynamo, case, extra):
    """An attention-sink model (gpt-oss), a 151,936-token vocabulary (the filters' 1,024 candidates and the
    whole-vocabulary sort beside them), bf16 weights and fp32 weights under bf16 autocast (the graph's
    logits are bf16; the draw runs in fp32, as the eager sampler's)."""
    model, autocast = serving_case(case)
    params = mixed_params(**extra)[:4]
    with autocast:
        drawn, gen = generate(model, params, True)
        assert gen.stats()["graph_draw_steps"] > 0
        eager, _ = generate(model, params, False)
    assert records(drawn) == records(eager)
    assert tops(drawn) == tops(eager)


def test_batch_invariant_mode_draws_after_the_graph(eager_dynamo):
    """batch_invariant() steps take the eager path (its kernels are the trainer's), the draw included."""
    model = tiny_model("llama")
    with batch_invariant():
        _, gen = generate(model, mixed_params()[:3], True)
    assert gen.stats()["graph_draw_steps"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, FILTERS["everything"]], ids=["temperatures", "filters"])
def test_inductor_graph_draws_give_the_eager_samplers_tokens(extra):
    """Compiled by inductor (fused kernels): the same tokens as the eager sampler on the same compiled
    logits, and log-probs within float rounding; with top-k, top-p, min-p and top log-probs rows too."""
    torch._dynamo.reset()
    model = tiny_model("llama")
    drawn, gen = generate(model, mixed_params(**extra), True)
    assert gen.stats()["graph_draw_steps"] > 0
    eager, _ = generate(model, mixed_params(**extra), False)
    torch._dynamo.reset()
    for a, b in zip(records(drawn), records(eager)):
        assert a[0] == b[0] and a[4:] == b[4:]
        for x, y in zip(a[1:4], b[1:4]):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=1e-5)
