"""Static and compiled decode on hybrid models: a padded decode step names each row's
state slot as a device tensor (padding rows: a scratch slot) and the conv, delta-rule and Mamba2
decode steps read and write the slots in place, so ``static_decode`` / ``compile_decode`` serve
Gated DeltaNet, KDA, short-convolution and Mamba2 layers: greedy output equals HF ``generate``
through chunked prefill, n > 1 samples, forks and preemption, and the compiled step is one graph
for every bucket (no graph break, which would split a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from tests.inference.test_inference_episodes import GREEDY as EPISODE
from tests.inference.test_inference_episodes import LIMITS, TOOLS, TokenFormat, reference_episode
from tests.inference.test_inference_generator import forward_logprobs, hf_greedy, prompts_of
from tests.inference.test_inference_hybrid import (
    FAMILIES,
    GREEDY,
    LENGTHS,
    assert_all_freed,
    assert_equals_reference,
    hybrid_model,
)

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


def assert_greedy_equals_hf(model, prompts, outs, max_tokens):
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0].token_ids
        assert completion == hf_greedy(model, prompt, max_tokens)
        ref = forward_logprobs(model, prompt, completion)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_decode_equals_hf_generate_with_chunked_prefill(family):
    """Three slots for five prompts (a slot reused must start from zero), a one-token prompt (its
    first step is a decode step from a fresh slot), chunks of 6 tokens, padded rows (5 -> 8)."""
    model = hybrid_model(family)
    prompts = prompts_of(LENGTHS)
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=3, static_decode=True)
    assert_greedy_equals_hf(model, prompts, gen.generate(prompts, GREEDY, use_tqdm=False), 8)
    runner = gen._runner
    assert runner.static_steps > 0 and {rows for rows, _ in runner.static_shapes} == {2, 3}
    states = gen._kv_cache.states
    assert states.scratch_slot == gen.scheduler.state_slots.num_rows  # one more row, after the snapshots'
    assert all(t.shape[0] == states.scratch_slot + 1 for t in states.tensors)
    assert_all_freed(gen)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_static_decode_samples_and_preemption(family):
    """n > 1 samples copy the prompt's final state (a fork of its slot) and sample what the default
    path samples; a cache too small for all preempts, and the state is recomputed."""
    model = hybrid_model(family)
    prompt = prompts_of([9], seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=8, ignore_eos=True)
    samples = {}
    for static in (False, True):
        gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=5, static_decode=static)
        samples[static] = [o.token_ids for o in gen.generate([prompt], params, use_tqdm=False)[0].outputs]
        assert (gen._runner.static_steps > 0) == static
    assert samples[True] == samples[False] and len(set(map(tuple, samples[True]))) > 1
    prompts = prompts_of([7, 11, 5, 9], seed=6)
    gen = Generator(model, block_size=2, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, static_decode=True)
    outs = gen.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert gen.stats()["preemptions"] > 0, "the small cache should preempt"
    assert_greedy_equals_hf(model, prompts, outs, 10)
    assert_all_freed(gen)


def test_static_decode_tool_episodes_fork_equal_hf():
    """Tool episodes that pause, resume and fork at their first tool result (each branch copies
    the state into a fresh slot before the next padded step)."""
    model = hybrid_model("qwen3_5")
    prompts = prompts_of([4, 9, 2, 15], seed=0)
    refs = [reference_episode(model, p, 12, LIMITS) for p in prompts]
    gen = Generator(model, block_size=4, num_blocks=256, static_decode=True)
    forked = gen.run_episodes(
        prompts, TOOLS, EPISODE, limits=LIMITS, tool_format=TokenFormat(), fork=lambda ep: 2 if ep.num_turns == 1 else 1
    )
    assert len(forked) > len(prompts) and gen._runner.static_steps > 0
    assert_equals_reference(model, forked, refs)
    assert_all_freed(gen)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_compiled_hybrid_decode_is_one_graph_and_exact(family, monkeypatch):
    """compile_decode on a delta-rule hybrid (its conv too) and a Mamba2 hybrid: one graph for every
    bucket (rows 2 and 3, table widths 4 and 8), no graph break (dynamo could not trace the
    Mamba2 mask hook's ContextVar.set: five graphs a step), the tokens of HF generate. Dynamo's
    eager backend: the graphs and guards are dynamo's, the kernels eager (an inductor compile
    takes minutes on a shared CPU; bench_hybrid.py --compile-decode runs it)."""
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: compile_(model, backend="eager", **kw))
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    model = hybrid_model(family)
    prompts = prompts_of(LENGTHS)
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=3, compile_decode=True)
    assert_greedy_equals_hf(model, prompts, gen.generate(prompts, GREEDY, use_tqdm=False), 8)
    assert len(gen._runner.static_shapes) > 1
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks
    torch._dynamo.reset()


def test_the_scratch_slot_comes_out_of_the_memory_budget():
    from nopad.inference.kv_cache import bytes_per_block, kv_layout
    from nopad.inference.state_cache import bytes_per_slot
    from tests.support.models import tiny_model

    model, budget = tiny_model("qwen3_5"), 1 << 20
    for static in (False, True):
        gen = Generator(
            model, block_size=4, kv_memory_bytes=budget, max_num_seqs=8, num_state_snapshots=0, static_decode=static
        )
        state = (8 + static) * bytes_per_slot(gen.layer_states, torch.float32)
        per_block = bytes_per_block(kv_layout(model.config), 4, torch.float32)
        assert gen.allocator.num_blocks == (budget - state) // per_block
