"""Persistent step state (:mod:`nopad.inference.decode_batch`): while the same sequences keep decoding,
the generator's step reads their arrays instead of walking every row in Python. Its outputs must be the
general step's, bit for bit (not only in ``batch_invariant()``: the rows, their order and every op are
the same), whatever ends the rows' turns, and its Python work must not grow with the rows."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from benchmarks.bench_decode_host import python_calls
from nopad.inference import Generator, SamplingParams
from nopad.packing import batch_invariant
from tests.inference.test_inference_episodes import STOPS, prompts_of
from tests.inference.test_inference_generator import hf_greedy
from tests.inference.test_inference_overlap import MIXED, completions, forked_tool_episodes
from tests.support.models import SERVING_CASES, serving_case, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


class Chars:  # a tokenizer whose text is one letter per token id
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def with_and_without(model, prompts, params, tokenizer=None, stream=False, overlap=False, **kwargs):
    """The completions (and streamed deltas) of a generator whose decode batch keeps its arrays (its
    steps overlapped with ``overlap``), and of one whose every step is the general, serial one; and the
    first generator. Overlapped runs are compared in ``batch_invariant()``: a row that ends at step N
    leaves N+1's batch later than a serial step's, and without the mode a log-prob's last bits depend on
    which rows share its step (the tokens do not)."""
    runs, gens = {}, {}
    for kept in (True, False):
        gen = gens[kept] = Generator(model, tokenizer, overlap=overlap and kept, **kwargs)
        if not kept:
            gen.decode_batch.serve = lambda: False
        with batch_invariant() if overlap else contextlib.nullcontext():
            deltas = None
            if stream:
                deltas = [(d.request_id, d.index, d.token_ids, d.finish_reason) for d in gen.stream(prompts, params)]
            runs[kept] = (deltas, completions(gen.generate(prompts, params, use_tqdm=False)))
        gen.allocator.check(owners=[])
    assert gens[True].stats()["decode_batch_steps"] > 0, "the kept arrays served no step"
    assert gens[False].stats()["decode_batch_steps"] == 0
    stats = gens[True].stats()
    assert (stats["overlap_steps"] > 0) == overlap
    if not overlap:  # the same steps, row for row (overlapped, a preemption can come a step apart)
        assert stats["decode_tokens"] == gens[False].stats()["decode_tokens"]
    return runs[True], runs[False], gens[True]


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])


@OVERLAP
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_sampling_equals_the_general_step(family, overlap):
    """Greedy, seeded temperature, n > 1, top-k / top-p / min-p, top log-probs, min_tokens, stop ids
    and prompt log-probs, with turns ending at different steps (each end changes the batch)."""
    prompts = prompts_of([5, 9, 3, 12, 7, 4])
    kept, general, _ = with_and_without(
        tiny_model(family), prompts, MIXED, overlap=overlap, block_size=4, num_blocks=256
    )
    assert kept == general


def test_an_overlapped_general_step_hands_forked_groups_to_the_batch():
    """GRPO's shape (groups of n = 4 samples, forked after their prompt's prefill) with overlap on: the
    overlapped general step took every later step, and the batch served none. It now hands the rows over
    once they are plain decodes (one counted break), and the outputs are the general step's."""
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=18, ignore_eos=True)
    kept, general, gen = with_and_without(
        tiny_model("llama"), prompts_of([5, 3, 8]), params, overlap=True, block_size=4, num_blocks=256
    )
    assert kept == general
    stats = gen.stats()
    assert stats["decode_batch_steps"] >= stats["steps"] - 4
    assert 1 <= stats["overlap_breaks"] <= 2  # the hand-over (per generate() call)


@OVERLAP
@pytest.mark.parametrize("penalty", [1.0, 1.3], ids=["plain", "penalised"])
def test_tool_episodes_decode_in_the_batch_as_in_the_general_step(overlap, penalty, monkeypatch):
    """Tool episodes' turns (forked after their first tool call) are served from the kept arrays too: every
    step of theirs took the general step. Overlapped, an episode that pauses at step N and resumes (its
    tool returned at once) before N+1 is read back must drop N+1's draw, which its tokens have outgrown:
    every tool call here is done before the decode loop goes on, so each resumes at the next poll. With a
    repetition penalty, each resumed turn's kept tokens hold the tool's output too."""
    import concurrent.futures as cf

    from nopad.inference.tools import ToolRunner

    submit = ToolRunner.submit

    def finished(self, calls, tools):
        futures, deadline = submit(self, calls, tools)
        cf.wait([f for f in futures if f is not None])
        return futures, deadline

    monkeypatch.setattr(ToolRunner, "submit", finished)
    runs, stats = {}, {}
    for kept in (True, False):
        gen = Generator(tiny_model("qwen2"), block_size=2, num_blocks=512, overlap=overlap and kept)
        if not kept:
            gen.decode_batch.serve = lambda: False
        runs[kept], calls = forked_tool_episodes(gen, repetition_penalty=penalty)
        stats[kept] = gen.stats()
    assert calls >= 2
    assert runs[True] == runs[False]
    assert stats[True]["decode_batch_steps"] > 0 == stats[False]["decode_batch_steps"]


@OVERLAP
def test_stop_strings_eos_and_streamed_deltas_equal_the_general_step(overlap):
    prompts = prompts_of([4, 8, 5, 6])
    model = tiny_model("llama")
    for params in (
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop=["e", "xy"], n=3),
        SamplingParams(max_tokens=40, temperature=1.0, seed=3, stop_token_ids=STOPS, n=3),
    ):
        kept, general, _ = with_and_without(model, prompts, params, Chars(), stream=True, overlap=overlap, block_size=4)
        assert sum(c[4] == "stop" for c in kept[1]) > 3 and kept == general


@OVERLAP
def test_blocks_grow_register_and_preempt_as_in_the_general_step(overlap):
    """Block size 2: a row needs a new block every other step (the kept table grows), fills one for the
    prefix cache every other step, and a small cache runs out: the general step preempts, the batch is
    built again afterwards."""
    prompts = prompts_of([6, 6, 9, 3]) * 2  # shared prompts: prefix-cache hits
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, n=2)
    kept, general, gen = with_and_without(
        tiny_model("llama"), prompts, params, overlap=overlap, block_size=2, num_blocks=48, max_num_seqs=6
    )
    assert gen.stats()["preemptions"] > 0 and gen.stats()["prefix_cache_hit_tokens"] > 0
    assert kept == general


def stepped(prompts, params, overlap: bool, between) -> dict[bool, list]:
    """Each request's output, by a caller's own ``step()`` loop, with the kept arrays (True, overlapped
    with ``overlap``) and with the general step only (False); ``between(gen, steps)`` runs after every
    step (an update, an abort)."""
    runs = {}
    for kept in (True, False):
        gen = Generator(tiny_model("llama"), block_size=4, overlap=overlap and kept)
        if not kept:
            gen.decode_batch.serve = lambda: False
        for i, prompt in enumerate(prompts):
            gen.add_request(prompt, params, request_id=f"r{i}")
        outs, steps = [], 0
        with batch_invariant() if overlap else contextlib.nullcontext():  # (see with_and_without)
            while gen.has_unfinished():
                outs += gen.step()
                steps += 1
                between(gen, steps)
        gen.allocator.check(owners=[])
        runs[kept] = {o.request_id: o for o in outs}
    return runs


@OVERLAP
def test_weight_updates_between_steps_stamp_each_token(overlap):
    """An update between two steps (stale_kv="keep" keeps the batch; "recompute" preempts every row
    and the batch is built again): the same tokens and versions as the general step's."""

    def update(gen, steps):
        if steps in (4, 7):
            gen.update_weights(stale_kv="keep" if steps == 4 else "recompute")

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    runs = {
        kept: sorted(completions(outs.values()))
        for kept, outs in stepped(prompts_of([5, 8, 3]), params, overlap, update).items()
    }
    assert runs[True] == runs[False]
    assert {v for c in runs[True] for v in c[9]} == {0, 1, 2}


@OVERLAP
@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_hybrid_models_keep_their_state_slots(family, overlap):
    """Mamba2 and Gated DeltaNet hybrids: each row's state slot is kept with its arrays; a small cache
    preempts (the slot is given back and taken again by the general step) and the batch is rebuilt."""
    prompts = prompts_of([5, 9, 3, 7])
    params = SamplingParams(max_tokens=14, temperature=0.9, seed=4, n=2)
    kept, general, gen = with_and_without(
        tiny_model(family), prompts, params, overlap=overlap, block_size=4, num_blocks=20, max_num_seqs=6
    )
    assert gen.stats()["preemptions"] > 0 and kept == general


@OVERLAP
@pytest.mark.parametrize("min_tokens", [0, 2], ids=["plain", "min_tokens"])
def test_python_calls_per_step_do_not_grow_with_rows(overlap, min_tokens):
    """The bookkeeping contract of #53: once a batch decodes steadily, a step's Python calls do not
    grow with its rows (the general step made ~3 a row, ~6 overlapped). Counted (noise-free) over
    greedy steps of 8 and 40 rows, none of which needs a new block or ends; with ``min_tokens`` met
    too (the sampler's ban walk visited every such row, every step)."""
    model = tiny_model("llama", num_hidden_layers=2)
    counts = {}
    for rows in (8, 40):
        gen = Generator(model, block_size=64, max_num_seqs=rows, num_blocks=rows + 2, overlap=overlap)
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, min_tokens=min_tokens)
        for prompt in prompts_of([3] * rows):
            gen.add_request(prompt, params)
        with gen.live.attention():
            for _ in range(3):  # prefill, then the batch is built
                gen.step()
            counts[rows] = python_calls(gen.step)
        assert gen.decode_batch.steps >= 2 and (gen.stats()["overlap_steps"] >= 2) == overlap
    per_row = (counts[40] - counts[8]) / 32
    assert per_row <= 0.25, f"{per_row:.2f} Python calls per added row ({counts})"


def test_vectorised_draws_equal_the_per_sequence_ones():
    """``uniform_draws`` (numpy's uint64 splitmix over a batch's kept keys) gives each row the float
    ``uniform_draw`` gives it: negative and 64-bit seeds, forked 63-bit streams, long positions."""
    import random
    from types import SimpleNamespace

    import numpy as np

    from nopad.inference.seeding import stream_keys, uniform_draw, uniform_draws

    rng = random.Random(0)
    seqs = [
        SimpleNamespace(
            request=SimpleNamespace(seed=rng.choice([rng.getrandbits(64) - (1 << 63), rng.getrandbits(62), 0, -1])),
            stream=rng.choice([i % 8, rng.getrandbits(63)]),
            num_tokens=rng.randrange(1, 1 << 20),
        )
        for i in range(2000)
    ]
    lengths = np.array([s.num_tokens for s in seqs], dtype=np.int64)
    assert uniform_draws(stream_keys(seqs), lengths) == [uniform_draw(s) for s in seqs]


@OVERLAP
def test_an_abort_between_steps_drops_the_row_from_the_batch_and_its_step_in_flight(overlap):
    """An abort between two steps (with overlap, while the batch's step is in flight): the aborted
    request's output says so and gains no token after it; the other requests' outputs are the
    general step's."""

    def abort(gen, steps):
        if steps == 5:
            assert gen.abort("r1")

    params = SamplingParams(max_tokens=12, temperature=1.0, seed=9)
    runs = stepped(prompts_of([5, 8, 3, 6]), params, overlap, abort)
    for rid in ("r0", "r2", "r3"):
        assert completions([runs[True][rid]]) == completions([runs[False][rid]])
    aborted = runs[True]["r1"].outputs[0]
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 12
    assert len(aborted.token_ids) == len(aborted.logprobs) == len(aborted.policy_versions)


def random_workload(seed: int):
    """A random mix of requests and generator sizes: sampling parameters, stop ids and strings,
    min_tokens, n, top log-probs, repetition penalties; block sizes, caches that preempt, budgets."""
    import random

    rng = random.Random(seed)

    def params():
        kw = dict(max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 0, 0.7, 1.0, 1.3]), seed=rng.randint(0, 9))
        for key, p, value in (
            ("n", 0.3, lambda: rng.randint(2, 3)),
            ("top_k", 0.2, lambda: rng.randint(1, 50)),
            ("top_p", 0.2, lambda: 0.9),
            ("logprobs", 0.2, lambda: rng.randint(0, 3)),
            ("stop", 0.2, lambda: [rng.choice(["e", "xy", "q"])]),
            ("stop_token_ids", 0.3, lambda: rng.sample(range(9, 128), 3)),
            ("min_tokens", 0.15, lambda: min(kw["max_tokens"], rng.randint(1, 5))),
            ("ignore_eos", 0.5, lambda: True),
            ("repetition_penalty", 0.1, lambda: 1.2),
        ):
            if rng.random() < p:
                kw[key] = value()
        return SamplingParams(**kw)

    family = rng.choice(["llama", "qwen3", "bamba"])
    overlap = rng.random() < 0.5
    prompts = prompts_of([rng.randint(1, 20) for _ in range(rng.randint(1, 8))], seed=seed)
    sizes = dict(
        block_size=rng.choice([2, 4, 16]),
        num_blocks=rng.choice([24, 48, 400]),
        max_num_seqs=rng.choice([2, 4, 16]),
        max_num_batched_tokens=rng.choice([16, 64, 2048]),
    )
    return family, overlap, prompts, [params() for _ in prompts], sizes


@pytest.mark.parametrize("seed", [2, 5, 10, 12, 21, 22])
def test_random_workloads_equal_the_general_step(seed):
    """Random workloads (75 seeds were run by hand while building this; these six are kept): the
    outputs with the kept arrays, serial or overlapped, are the general step's."""
    family, overlap, prompts, params, sizes = random_workload(seed)
    kept, general, _ = with_and_without(tiny_model(family), prompts, params, Chars(), overlap=overlap, **sizes)
    assert kept == general


@pytest.mark.parametrize("case", SERVING_CASES)
def test_sinks_a_large_vocabulary_and_bf16_equal_the_general_step(case):
    """An attention-sink model (gpt-oss), a Qwen-sized vocabulary (151,936: numpy's argmax and the kept
    arrays over it), bf16 weights, and fp32 weights under bf16 autocast (the logits the sampler gets
    are bf16)."""
    model, autocast = serving_case(case)
    params = [SamplingParams(max_tokens=10, temperature=0), SamplingParams(max_tokens=14, temperature=1.0, seed=3, n=2)]
    with autocast:
        kept, general, _ = with_and_without(model, prompts_of([5, 9]), params, block_size=4)
    assert kept == general


PENALISED = [
    SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.8, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=14, temperature=0.8, seed=2, repetition_penalty=0.7, n=2, ignore_eos=True),
    SamplingParams(max_tokens=18, temperature=1.0, seed=5, top_k=6, repetition_penalty=1.3, logprobs=2),
    SamplingParams(max_tokens=9, temperature=1.2, seed=8, ignore_eos=True),
]


@OVERLAP
@pytest.mark.parametrize("family", ["llama", "bamba"])
def test_repetition_penalties_decode_in_the_batch(family, overlap):
    """Rows with a repetition penalty (greedy and sampled, above and below 1, beside rows without one) are
    served by the kept arrays, from a device mask their own draws update, overlapped too: before, one such
    row sent every step of the batch to the general step. The outputs are the general step's, and the
    batch serves every decode step once the prompts are in."""
    prompts = prompts_of([5, 9, 3, 12, 7])
    kept, general, gen = with_and_without(
        tiny_model(family), prompts, PENALISED, overlap=overlap, block_size=4, num_blocks=256
    )
    assert kept == general
    stats = gen.stats()
    assert stats["decode_batch_steps"] >= stats["steps"] - 6, stats  # prefill steps and the rebuilds after them


def test_repetition_penalty_greedy_equals_hf_generate():
    """Greedy with a repetition penalty over prompt and output, decoded by the kept arrays: HF ``generate``'s
    tokens (its ``RepetitionPenaltyLogitsProcessor``), each prompt alone; and the penalty changes them."""
    model = tiny_model("llama")
    prompts = prompts_of([6, 11, 4])
    gen = Generator(model, block_size=4, num_blocks=128)
    for penalty in (1.6, 0.6):
        params = SamplingParams(max_tokens=16, temperature=0, repetition_penalty=penalty, ignore_eos=True)
        outs = gen.generate(prompts, params, use_tqdm=False)
        plain = gen.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ref = hf_greedy(model, prompt, 16, repetition_penalty=penalty, eos_token_id=None)
            assert out.outputs[0].token_ids == ref
        assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in plain]
    assert gen.stats()["decode_batch_steps"] > 0


def test_seen_tokens_follow_the_rows_kept():
    """The kept tokens move with the batch's rows when some leave (compacted at the front, in order), a
    row's draw joins its own row, and the pairs (CPU) and the mask (a compiled step's) penalise alike."""
    import numpy as np

    from nopad.inference.penalties import SeenTokens

    def seq(tokens, penalty=1.0):
        return SimpleNamespace(
            token_ids=tokens, request=SimpleNamespace(params=SamplingParams(repetition_penalty=penalty))
        )

    seen = SeenTokens(4, 6, torch.device("cpu"))
    seen.fill([seq([1, 2], 2.0), seq([3]), seq([0, 4, 4], 0.5)])
    seen.saw(torch.tensor([5, 0, 1]))
    x = torch.tensor([[-1.0, 2.0, 3.0, 1.0, 0.0, -2.0]] * 3)
    by_pairs = seen.apply(x)
    mask, penalty = (t[:3] for t in seen.graph_inputs())
    assert mask.nonzero().tolist() == [[0, 1], [0, 2], [0, 5], [1, 0], [1, 3], [2, 0], [2, 1], [2, 4]]
    assert torch.equal(seen.apply(x), by_pairs)  # (the pairs still apply on CPU)
    seen.keep(np.array([True, False, True]))
    mask, penalty = (t[:2] for t in seen.graph_inputs())
    assert mask.nonzero().tolist() == [[0, 1], [0, 2], [0, 5], [1, 0], [1, 1], [1, 4]]
    assert penalty.tolist() == [2.0, 0.5]
    expected = [[-1.0, 1.0, 1.5, 1.0, 0.0, -4.0], [-0.5, 4.0, 3.0, 1.0, 0.0, -2.0]]
    assert seen.apply(x[:2]).tolist() == expected
    seen.pairs = None  # the mask alone (an accelerator's form)
    assert seen.apply(x[:2]).tolist() == expected


@OVERLAP
def test_requests_with_prompt_logprobs_decode_in_the_batch_once_scored(overlap):
    """A request's prompt log-probs are all scored by its prefill, and its decode steps read none of them:
    the batch serves those steps (any such request sent every step of its batch to the general step)."""
    params = [
        SamplingParams(max_tokens=14, temperature=0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, prompt_logprobs=0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=4, ignore_eos=True),
    ]
    kept, general, gen = with_and_without(
        tiny_model("llama"), prompts_of([5, 9, 7]), params, overlap=overlap, block_size=4, num_blocks=256
    )
    assert kept == general
    assert all(c[-1] is not None for c in kept[1][:2])  # (the prompt log-probs are in the records compared)
    stats = gen.stats()
    assert stats["decode_batch_steps"] >= stats["steps"] - 4, stats
